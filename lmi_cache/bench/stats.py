"""Summary statistics for benchmark rounds (pure; runs in the bench process).

Percentiles interpolate linearly between closest ranks, the same rule as
numpy's default, so numbers compare with other tools' reports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear interpolation."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = position - lower
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


@dataclass(frozen=True)
class Summary:
    """Count, mean, p50, p90, min and max of a set of durations (seconds)."""

    count: int
    mean: float
    p50: float
    p90: float
    min: float
    max: float

    def to_dict(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.p50,
            "p90": self.p90,
            "min": self.min,
            "max": self.max,
        }


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise ValueError("cannot summarize an empty sequence")
    return Summary(
        count=len(values),
        mean=math.fsum(values) / len(values),
        p50=percentile(values, 50.0),
        p90=percentile(values, 90.0),
        min=min(values),
        max=max(values),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the divisor is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


@dataclass(frozen=True)
class RoundStats:
    """What one round measured: TTFT and request latency summaries, wall time, tokens."""

    name: str
    num_requests: int
    ttft_s: Summary
    request_latency_s: Summary
    round_latency_s: float
    prompt_tokens: int | None
    completion_tokens: int | None

    @property
    def prompt_tokens_per_s(self) -> float | None:
        """Prefill throughput of the round (prompt tokens over wall time)."""
        if self.prompt_tokens is None:
            return None
        return ratio(float(self.prompt_tokens), self.round_latency_s)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "ttft_s": self.ttft_s.to_dict(),
            "request_latency_s": self.request_latency_s.to_dict(),
            "round_latency_s": self.round_latency_s,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_per_s": self.prompt_tokens_per_s,
        }


def round_stats(
    name: str,
    ttfts_s: Sequence[float],
    latencies_s: Sequence[float],
    round_latency_s: float,
    prompt_tokens: Sequence[int | None],
    completion_tokens: Sequence[int | None],
) -> RoundStats:
    """Summarise one round; token totals are None unless every request reported them."""

    def total(counts: Sequence[int | None]) -> int | None:
        if not counts or any(c is None for c in counts):
            return None
        return sum(c for c in counts if c is not None)

    return RoundStats(
        name=name,
        num_requests=len(ttfts_s),
        ttft_s=summarize(ttfts_s),
        request_latency_s=summarize(latencies_s),
        round_latency_s=round_latency_s,
        prompt_tokens=total(prompt_tokens),
        completion_tokens=total(completion_tokens),
    )
