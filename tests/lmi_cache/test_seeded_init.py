"""Tiny models built at once in two threads get the same weights as built one after the other (fast tier)."""
from __future__ import annotations

import threading
import time

import torch

from lmi_cache.devtools.tiny_model import seeded_init


def _draw(seed: int, out: list[torch.Tensor], pause_s: float) -> None:
    with seeded_init(seed):
        first = torch.randn(64)
        time.sleep(pause_s)  # another builder would reseed the process-wide RNG here without the lock
        out.append(torch.cat([first, torch.randn(64)]))


def test_concurrent_builders_draw_what_a_lone_builder_draws() -> None:
    alone: list[torch.Tensor] = []
    _draw(7, alone, 0.0)
    results: list[torch.Tensor] = []
    threads = [threading.Thread(target=_draw, args=(7, results, 0.05)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and all(torch.equal(r, alone[0]) for r in results)


def test_the_callers_rng_state_is_left_as_it_was() -> None:
    torch.manual_seed(123)
    expected = torch.randn(8)
    torch.manual_seed(123)
    with seeded_init(0):
        torch.randn(100)
    assert torch.equal(torch.randn(8), expected)
