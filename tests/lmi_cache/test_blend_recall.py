"""Blending on a trained model: answer accuracy at the default ratio stays near full prefill, above naive reuse.

Uses the tiny Llama committed in tests/fixtures/blend/recall_model (trained by
benchmarks/train_recall_model.py) on fresh prompts of the same recall task.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.quality import BlendCase, Condition, QualityTally, run_conditions
from lmi_cache.blend.recall_task import BOS, RecallTask, sample_prompt

MODEL_DIR = Path(__file__).resolve().parents[1] / "fixtures/blend/recall_model"
NUM_PROMPTS = 200


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[float, float]]:
    """(accuracy, mean KL vs full prefill) per condition."""
    from transformers import LlamaForCausalLM

    task = RecallTask(**json.loads((MODEL_DIR / "task.json").read_text()))
    model: Any = LlamaForCausalLM.from_pretrained(str(MODEL_DIR)).float().eval()
    adapter = HFLayerwiseModel(model)
    conditions = [
        Condition("full", "full"), Condition("naive", "naive"), Condition("blend", "blend", 0.15),
        Condition("random", "blend", 0.15, "random"), Condition("blend 1", "blend", 1.0),
    ]
    rng = random.Random(4242)  # not the training or benchmark seed
    tally = QualityTally()
    for i in range(NUM_PROMPTS):
        prompt = sample_prompt(task, rng)
        case = BlendCase(torch.tensor([BOS]), tuple(torch.tensor(d) for d in prompt.docs),
                         torch.tensor(prompt.tail_ids()))
        tally.add(run_conditions(adapter, case, conditions, seed=i), reference="full", answer=prompt.questions[0][1])
    return {row.condition: (float(row.accuracy or 0.0), row.mean_kl) for row in tally.rows()}


def test_the_model_learned_more_than_chance(measured: dict[str, tuple[float, float]]) -> None:
    task = RecallTask(**json.loads((MODEL_DIR / "task.json").read_text()))
    in_context_values = task.num_docs * task.pairs_per_doc
    assert measured["full"][0] > 1.5 / in_context_values  # copying any value in context scores 1/16
    assert measured["blend 1"][0] == measured["full"][0] and measured["blend 1"][1] < 1e-9


def test_default_ratio_stays_within_two_points_of_full_prefill(measured: dict[str, tuple[float, float]]) -> None:
    assert measured["blend"][0] >= measured["full"][0] - 0.02


def test_blending_is_far_closer_to_full_prefill_than_naive_reuse(measured: dict[str, tuple[float, float]]) -> None:
    assert measured["blend"][1] * 10 < measured["naive"][1]
    assert measured["blend"][0] > measured["naive"][0]
