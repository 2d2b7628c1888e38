"""Prompts given as embeddings (``enable_prompt_embeds``) are cached by their content (vLLM CPU).

vLLM stands zeros in for the token ids of such a prompt, so before the chunk
keys covered the embeddings these prompts were never cached. Now the same
embeddings hit and equal vLLM without a connector; other embeddings of the
same length miss.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import assert_same_outputs, cache_env, expected_hit_tokens, gen_phase, phase, run_job

ROWS = 600
KWARGS = {"enable_prompt_embeds": True}


def embeds(seed: int) -> list[dict[str, Any]]:
    return [{"embeds": {"seed": seed, "rows": ROWS}}]


@pytest.fixture(scope="module")
def runs(tiny_model: Path, e2e_dir: Path) -> dict[str, Any]:
    work = e2e_dir / "prompt-embeds"
    reference = run_job({"model": str(tiny_model), "connector": False, "llm_kwargs": KWARGS, "phases": [
        gen_phase("one", embeds(1)), gen_phase("two", embeds(2)),
    ]}, work / "reference")
    cached = run_job({"model": str(tiny_model), "connector": True, "env": cache_env(None), "llm_kwargs": KWARGS,
                      "phases": [
        gen_phase("one", embeds(1)), gen_phase("one_again", embeds(1), before=["flush"]),
        gen_phase("two", embeds(2)),
    ]}, work / "cached")
    return {"reference": reference, "cached": cached}


def test_the_same_embeddings_hit_and_answer_as_without_a_cache(runs: dict[str, Any]) -> None:
    ref = phase(runs["reference"], "one")
    assert ref["outputs"][0]["tokens"] != phase(runs["reference"], "two")["outputs"][0]["tokens"]
    assert_same_outputs(phase(runs["cached"], "one"), ref)
    again = phase(runs["cached"], "one_again")
    assert again["outputs"][0]["num_cached_tokens"] == expected_hit_tokens(ROWS)
    assert_same_outputs(again, ref, logprob_atol=1e-4)


def test_other_embeddings_of_the_same_length_miss(runs: dict[str, Any]) -> None:
    two = phase(runs["cached"], "two")
    assert two["outputs"][0]["num_cached_tokens"] == 0
    assert_same_outputs(two, phase(runs["reference"], "two"))
