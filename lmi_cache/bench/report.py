"""Renders benchmark results as a markdown table or JSON (bench process, pure)."""
from __future__ import annotations

import json
from typing import Any, Sequence

from lmi_cache.bench.runner import BenchResult


def fmt_seconds(value: float | None) -> str:
    """Seconds with 3 significant digits, or an em dash when missing."""
    if value is None:
        return "—"
    return f"{value:.3g}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}x" if value >= 0.01 else f"{value:.2e}x"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def rounds_table(result: BenchResult) -> str:
    """One row per round: TTFT mean/p50/p90, request p50, round latency, prefill tok/s."""
    header = [
        "round",
        "requests",
        "TTFT mean (s)",
        "TTFT p50 (s)",
        "TTFT p90 (s)",
        "latency p50 (s)",
        "round latency (s)",
        "prompt tok/s",
    ]
    rows = []
    for item in result.rounds:
        stats = item.stats
        per_s = stats.prompt_tokens_per_s
        rows.append(
            [
                stats.name,
                str(stats.num_requests),
                fmt_seconds(stats.ttft_s.mean),
                fmt_seconds(stats.ttft_s.p50),
                fmt_seconds(stats.ttft_s.p90),
                fmt_seconds(stats.request_latency_s.p50),
                fmt_seconds(stats.round_latency_s),
                "—" if per_s is None else f"{per_s:.0f}",
            ]
        )
    return markdown_table(header, rows)


def text_report(result: BenchResult) -> str:
    """The table plus a line of ratios (last round over first)."""
    settings = ", ".join(
        f"{key}={value}" for key, value in result.settings.items() if not isinstance(value, list)
    )
    parts = [f"workload {result.workload}: {settings}", "", rounds_table(result)]
    ratios = result.ratios()
    if ratios:
        last, first = result.rounds[-1].stats.name, result.rounds[0].stats.name
        parts += [
            "",
            f"{last}/{first}: TTFT mean {fmt_ratio(ratios['ttft_mean'])}, "
            f"TTFT p50 {fmt_ratio(ratios['ttft_p50'])}, round latency {fmt_ratio(ratios['round_latency'])}",
        ]
    return "\n".join(parts)


def to_json_dict(result: BenchResult) -> dict[str, Any]:
    return {
        "workload": result.workload,
        "settings": result.settings,
        "rounds": [item.stats.to_dict() for item in result.rounds],
        "ratios": result.ratios(),
        "requests": [record.to_dict() for item in result.rounds for record in item.records],
    }


def to_json(result: BenchResult) -> str:
    return json.dumps(to_json_dict(result), indent=2, sort_keys=False)
