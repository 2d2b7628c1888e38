"""Blending on a trained model: the properties the committed accuracy table claims, re-measured.

Uses the tiny Llama committed in tests/fixtures/blend/recall_model (trained by
benchmarks/train_recall_model.py) on the first 300 of the benchmark's 1,000
prompts (same seed; CI budget, about 10 CPU-seconds on one thread). KL and
greedy agreement are those of the answer's position (the first generated token).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lmi_cache.blend.quality import Condition, QualityTally
from lmi_cache.blend.recall_task import RecallTask, measure

MODEL_DIR = Path(__file__).resolve().parents[1] / "fixtures/blend/recall_model"
NUM_PROMPTS = 300
BENCHMARK_SEED = 1_000_003  # benchmarks/train_recall_model.py: seed 0 + 1_000_003
FULL = "full prefill"  # the tally's reference condition


@pytest.fixture(scope="module")
def tally() -> QualityTally:
    from transformers import LlamaForCausalLM

    task = RecallTask(**json.loads((MODEL_DIR / "task.json").read_text()))
    model: Any = LlamaForCausalLM.from_pretrained(str(MODEL_DIR)).float().eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only spins (and the host is shared)
    conditions = [
        Condition(FULL, "full"), Condition("naive", "naive"), Condition("blend", "blend", 0.15),
        Condition("random", "blend", 0.15, "random"), Condition("blend 1", "blend", 1.0),
        Condition("ratio 0", "blend", 0.0), Condition("one check", "blend", 0.15, gradual=False),
    ]
    try:
        return measure(model, task, NUM_PROMPTS, seed=BENCHMARK_SEED, conditions=conditions, first_token=True)["all"]
    finally:
        torch.set_num_threads(threads)


def _rows(tally: QualityTally) -> dict[str, tuple[float, float]]:
    return {row.condition: (float(row.accuracy or 0.0), row.mean_kl) for row in tally.rows()}


def test_the_model_learned_the_task(tally: QualityTally) -> None:
    assert _rows(tally)[FULL][0] >= 0.8


def test_ratio_one_is_full_prefill_exactly(tally: QualityTally) -> None:
    rows = _rows(tally)
    assert tally.prompt_correct["blend 1"] == tally.prompt_correct[FULL]
    assert rows["blend 1"][1] < 1e-9


def test_default_ratio_stays_within_two_points_of_full_prefill(tally: QualityTally) -> None:
    rows = _rows(tally)
    assert rows["blend"][0] >= rows[FULL][0] - 0.02


def test_default_ratio_cuts_the_kl_of_no_recompute_past_the_check_layer(tally: QualityTally) -> None:
    rows = _rows(tally)
    assert rows["blend"][1] <= 0.9 * rows["ratio 0"][1]


def test_gradual_filtering_beats_one_check_keeping_the_count(tally: QualityTally) -> None:
    """One check layer keeping 15% left about twice the KL of gradual filtering (0.22x of ratio 0 against 0.11x)."""
    rows = _rows(tally)
    assert rows["blend"][1] <= 0.7 * rows["one check"][1]
    paired = tally.compare("blend", "one check")
    assert paired.a_lower_kl > paired.b_lower_kl and paired.a_only_correct >= paired.b_only_correct


def test_blending_beats_naive_reuse_of_the_cached_kv(tally: QualityTally) -> None:
    rows = _rows(tally)
    assert rows["naive"][0] <= rows[FULL][0] - 0.05
    assert rows["blend"][0] >= rows["naive"][0] + 0.1
    assert rows["blend"][1] * 2 < rows["naive"][1]


def test_topk_selection_beats_random_selection_of_as_many_tokens(tally: QualityTally) -> None:
    paired = tally.compare("blend", "random")
    assert paired.a_only_correct >= paired.b_only_correct
    assert paired.a_lower_kl > paired.b_lower_kl and paired.kl_sign_p < 0.01
