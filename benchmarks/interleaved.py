"""Timing helper the benchmarks share: functions take turns, so a shared host's load hits each alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def medians(rounds: int, fns: dict[str, Callable[[], object]], warm_up: bool = False) -> dict[str, float]:
    """Median seconds of each function, the functions taking turns round after round.

    ``warm_up`` runs each once first, unmeasured (plans, page faults, first-call costs).
    """
    if warm_up:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}
