"""Benchmark: wall time of ``lmi-cache plan`` end to end, as a fresh process.

Run from the repository root (its own process; the CLI runs as subprocesses):
    .venv/bin/python benchmarks/bench_plan.py [--runs 20] [--model DIR]
Prints the median and max wall time of each case; the target is < 1 s. The
"probe" case probes this machine (GPUs, cgroups, disks, an O_DIRECT test
file); the "snapshot" case reads a host snapshot file instead.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "tests" / "fixtures" / "hf_configs" / "llama-3.1-8b-instruct"
SNAPSHOT = REPO / "tests" / "fixtures" / "hosts" / "a100x8_nvme_cgroup.json"
TARGET_S = 1.0


def _command() -> list[str]:
    """The installed console script when present (what users run), else the module."""
    script = Path(sys.executable).with_name("lmi-cache")
    if script.exists():
        return [str(script)]
    found = shutil.which("lmi-cache")
    return [found] if found else [sys.executable, "-m", "autoconfig.cli"]


def _time_runs(args: list[str], runs: int) -> list[float]:
    times = []
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "0"}
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    opts = parser.parse_args()
    base = [*_command(), "plan", "--model", opts.model]
    cases = {
        "probe (this machine)": base,
        "snapshot (--host-snapshot, 8 GPUs, --tp 8)": [*base, "--tp", "8", "--host-snapshot", str(SNAPSHOT), "--json"],
    }
    _time_runs(base, 2)  # warm the page cache and .pyc files
    worst = 0.0
    for name, args in cases.items():
        times = _time_runs(args, opts.runs)
        median = statistics.median(times)
        worst = max(worst, median)
        print(f"{name:<36} median {median * 1000:7.1f} ms  max {max(times) * 1000:7.1f} ms  ({opts.runs} runs)")
    verdict = "OK" if worst < TARGET_S else "SLOW"
    print(f"target < {TARGET_S:.1f} s: {verdict}")


if __name__ == "__main__":
    main()
