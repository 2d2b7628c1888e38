"""An adapter replaced in place under the same name: its old KV is never served (vLLM CPU, one connector run).

The adapter ``tenant`` lives in one folder. The connector job runs a prompt
with it, then the folder's files are replaced by another adapter's (same name,
same path; vLLM loads them under a new adapter id) and the prompt is sent
again: it must miss and answer like the new adapter without a connector, and
its repeat must hit. Before the chunk keys covered the adapter's content, the
second request loaded the old adapter's KV.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import SALTED, assert_same_outputs, cache_env, expected_hit_tokens, gen_phase, phase, prompts, run_job

LORA_KWARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, e2e_dir: Path) -> dict[str, Any]:
    from lmi_cache.devtools.tiny_lora import make_tiny_lora

    work = e2e_dir / "adapter-replaced"
    old = make_tiny_lora(tiny_model, work / "old", seed=1)
    new = make_tiny_lora(tiny_model, work / "new", seed=2)
    served = make_tiny_lora(tiny_model, work / "served", seed=1)  # the folder replaced in place
    before = {"name": "tenant", "id": 1, "path": str(served)}
    after = {"name": "tenant", "id": 2, "path": str(served)}
    reference = run_job({"model": str(tiny_model), "connector": False, "llm_kwargs": LORA_KWARGS, "phases": [
        gen_phase("old", prompts([SALTED], lora={"name": "tenant", "id": 1, "path": str(old)})),
        gen_phase("new", prompts([SALTED], lora={"name": "tenant", "id": 2, "path": str(new)})),
    ]}, work / "reference")
    cached = run_job({"model": str(tiny_model), "connector": True, "env": cache_env(None),
                      "llm_kwargs": LORA_KWARGS, "replace_adapter": {"src": str(new), "dst": str(served)}, "phases": [
        gen_phase("old", prompts([SALTED], lora=before)),
        gen_phase("old_again", prompts([SALTED], lora=before)),
        gen_phase("replaced", prompts([SALTED], lora=after), before=["replace_adapter"]),
        gen_phase("replaced_again", prompts([SALTED], lora=after)),
    ]}, work / "cached")
    return {"reference": reference, "cached": cached}


def test_the_two_adapters_answer_differently(runs: dict[str, Any]) -> None:
    old, new = (phase(runs["reference"], name)["outputs"][0]["tokens"] for name in ("old", "new"))
    assert old != new


def test_the_old_adapter_hits_before_the_replacement(runs: dict[str, Any]) -> None:
    again = phase(runs["cached"], "old_again")
    assert again["outputs"][0]["num_cached_tokens"] == expected_hit_tokens(len(SALTED))
    assert_same_outputs(again, phase(runs["reference"], "old"), logprob_atol=1e-4)


def test_the_replaced_adapter_misses_then_hits_its_own_kv(runs: dict[str, Any]) -> None:
    replaced = phase(runs["cached"], "replaced")
    print("replaced:", replaced["outputs"][0]["tokens"], "cached tokens:", replaced["outputs"][0]["num_cached_tokens"])
    assert_same_outputs(replaced, phase(runs["reference"], "new"), logprob_atol=1e-4)
    assert replaced["outputs"][0]["num_cached_tokens"] == 0
    again = phase(runs["cached"], "replaced_again")
    assert again["outputs"][0]["num_cached_tokens"] == expected_hit_tokens(len(SALTED))
    assert_same_outputs(again, phase(runs["reference"], "new"), logprob_atol=1e-4)
