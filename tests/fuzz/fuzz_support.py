"""Strategies and checks shared by the input fuzz tests (test process only).

Each fuzz test feeds generated input through the real entry point (the click CLI
in-process, or the loader the engine uses) and checks the promise: exit status
0, 1 or 2, never a traceback, a user error as one line, and any plan it prints
within the host it was planned for. ``LMI_CACHE_FUZZ_SCALE`` multiplies the
example counts (CI runs scale 1, a few seconds per target; nightly or local
hunting can run 20 and a random seed with ``LMI_CACHE_FUZZ_RANDOM=1``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from autoconfig.cli import main

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "fixtures" / "hf_configs"
HOSTS = REPO / "tests" / "fixtures" / "hosts"
_scale = os.environ.get("LMI_CACHE_FUZZ_SCALE", "1").strip()
SCALE = max(1, int(_scale)) if _scale.isdigit() else 1
RANDOM = os.environ.get("LMI_CACHE_FUZZ_RANDOM") == "1"
# Every generated case is counted here per target and outcome; test_zz_report prints the totals.
CASES: dict[str, dict[str, int]] = {}


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples * SCALE, deadline=None, derandomize=not RANDOM, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def count(target: str, outcome: str) -> None:
    """Record one generated case of ``target`` and how it ended (exit status, or accepted/refused)."""
    per = CASES.setdefault(target, {})
    per[outcome] = per.get(outcome, 0) + 1


def report() -> str:
    parts = [f"{target} {sum(per.values())} ({', '.join(f'{k}: {v}' for k, v in sorted(per.items()))})"
             for target, per in CASES.items()]
    return "; ".join(parts) + f"; total {sum(sum(per.values()) for per in CASES.values())}"


# Strings that broke parsers before: non-finite and huge numbers, paths that can never work.
NASTY_STRINGS = ["nan", "NaN", "inf", "-inf", "Infinity", "1e308", "-1e308", "1e15", "-1", "0", "1", "2", "3", "256",
                 "0.5", "99999999999999999999999", "9" * 400, "abc", "", " ", "true", "false", "max", "None",
                 "/tmp/lmcache", "/proc/lmcache", "/mnt/a,b/kv", "relative/dir", "file:///tmp/lmcache/",
                 "file://", "/tmp/a\tb", "'512'", "\"file:///x/\"", "{\"use_odirect\": true}", "'{\"a\": 1}'",
                 "[1, 2", "{", "lm://localhost:65432", "redis://h", "redis://h:99999", "ftp://x", "\u00e9\u00e8",
                 "--trust-remote-code", "a=b", "x y", "[" * 3000 + "]" * 3000, '{"a": ' + "9" * 5000 + "}",
                 '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}',
                 # a lone UTF-16 half as a Java escape, a whole pair, and a name longer than any filesystem takes
                 "\\ud800", "x\\udfff", "\\ud83d\\ude00", "a" * 300, "/tmp/" + "b" * 300 + "/kv"]
nasty_text = st.one_of(st.sampled_from(NASTY_STRINGS), st.text(max_size=24))
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 7, 64, 128, 4096, 10**15, 2**63, 10**400, 1e15, 1e308, -1]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, nasty_text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)


def run_cli(args: list[str], env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, args, env=env)


def assert_clean_exit(result: Result, allowed: tuple[int, ...] = (0, 1, 2)) -> None:
    """Exit 0/1/2 through SystemExit (never an escaped exception), no traceback, one error line."""
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), f"escaped {type(exc).__name__}: {exc!r}\n{result.output}"
    assert result.exit_code in allowed, (result.exit_code, result.output[-2000:])
    assert "Traceback" not in result.output, result.output[-2000:]
    if result.exit_code == 2:
        errors = [line for line in result.output.splitlines() if line.startswith(("lmi-cache: error:", "Error:"))]
        assert len(errors) == 1, result.output[-2000:]


def assert_plan_within_host(plan: dict[str, Any], host: dict[str, Any]) -> None:
    """What the plan allocates on every rank of this host fits the host's RAM and the chosen disk."""
    ranks = plan["parallel"]["ranks_per_host"]
    memory = host["memory"]
    usable = memory["available_bytes"]
    if memory.get("cgroup_limit_bytes") is not None:
        usable = min(usable, max(0, memory["cgroup_limit_bytes"] - (memory.get("cgroup_usage_bytes") or 0)))
    cpu = plan["tiers"]["cpu"]
    if cpu["enabled"]:
        assert cpu["bytes_per_rank"] * ranks <= usable, (cpu, ranks, usable)
    disk = plan["tiers"]["disk"]
    if disk["enabled"] and disk["mount"] is not None:
        free = next(d["free_bytes"] for d in host["disks"] if d["mount"] == disk["mount"])
        assert disk["bytes_per_rank"] * ranks <= free, (disk, ranks, free)
        assert "," not in disk["path"] and disk["path"].startswith("/")


def load_host(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((HOSTS / name).read_text())
    return data
