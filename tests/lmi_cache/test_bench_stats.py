"""Stats math (percentiles against numpy, summaries, ratios) and token fitting."""
from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.bench.stats import percentile, ratio, round_stats, summarize
from lmi_cache.bench.tokens import fit_num_words

durations = st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(values=durations, q=st.floats(min_value=0.0, max_value=100.0))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert math.isclose(percentile(values, q), float(np.percentile(values, q)), rel_tol=1e-9, abs_tol=1e-9)


def test_percentile_small_cases() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == pytest.approx(9.1)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@settings(max_examples=100, deadline=None)
@given(values=durations)
def test_summary_is_ordered(values: list[float]) -> None:
    summary = summarize(values)
    assert summary.count == len(values)
    assert summary.min <= summary.p50 <= summary.p90 <= summary.max
    assert summary.min - 1e-9 <= summary.mean <= summary.max + 1e-9


def test_ratio_handles_missing_and_zero() -> None:
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(None, 4.0) is None
    assert ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None


def test_round_stats_totals_and_throughput() -> None:
    stats = round_stats("warmup", [0.1, 0.3], [0.2, 0.5], 0.5, [100, 300], [4, 4])
    assert stats.num_requests == 2
    assert stats.ttft_s.mean == pytest.approx(0.2)
    assert stats.prompt_tokens == 400 and stats.completion_tokens == 8
    assert stats.prompt_tokens_per_s == pytest.approx(800.0)
    missing = round_stats("q", [0.1], [0.2], 0.2, [None], [None])
    assert missing.prompt_tokens is None and missing.prompt_tokens_per_s is None


def _word_cost_counter(costs: list[int]):  # type: ignore[no-untyped-def]
    """A tokenizer where word i costs costs[i % len(costs)] tokens."""

    async def count(text: str) -> int:
        return sum(costs[i % len(costs)] for i in range(len(text.split())))

    return count


@settings(max_examples=100, deadline=None)
@given(target=st.integers(1, 20000), costs=st.lists(st.integers(1, 4), min_size=1, max_size=7))
def test_fit_never_overshoots_and_lands_close(target: int, costs: list[int]) -> None:
    count = _word_cost_counter(costs)
    num_words, num_tokens = asyncio.run(fit_num_words(target, lambda n: "w " * n, count))
    assert num_tokens == asyncio.run(count("w " * num_words))
    if costs[0] <= target:
        assert num_tokens <= target
        # Close: within the tolerance, or adding one more word would overshoot.
        next_tokens = asyncio.run(count("w " * (num_words + 1)))
        assert target - num_tokens < max(1, target // 500) or next_tokens > target
