"""The other features with a sliding-window model (Gemma-2 shape: a windowed and a full group), vLLM CPU, float32.

The sliding-window module proves the CPU and disk tiers; this one the rest,
each check against vLLM without a connector and each counting what was
loaded (a hit that loads the wrong chunks, or none, fails):

- remote tier: a writer process (CPU tier + Redis) fills Redis; a fresh
  reader process, whose CPU tier starts empty, gets every hit from Redis and
  reads only the windowed group's last window plus the full group's prefix;
- ``cache_salt`` and LoRA namespaces: another salt, or another adapter (or
  none) over the same tokens, is a miss that loads nothing; the same one hits;
- tensor parallelism 2: both ranks register both groups and the warm run hits.

Sessions through the LMI front door are in the session module beside this one.
One vLLM start per configuration (reference, writer, reader, TP), all module-scoped.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    CHUNK_TOKENS,
    DOCS,
    HMA_OFF_LINE,
    SALTED,
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

from lmi_cache.devtools.redis_server import RedisServer

SHAPE = "gemma2-7m"
GROUPS = window_groups(SHAPE)
TP_DOCS = DOCS[:4]
# LoRA on in every job of the module, so that base outputs compare across them bit for bit.
LORA_KWARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
SALTED_HIT = expected_hit_tokens(len(SALTED))


@pytest.fixture(scope="module")
def adapters(gemma2_model: Path, e2e_dir: Path) -> dict[str, dict[str, Any]]:
    from lmi_cache.devtools.tiny_lora import make_tiny_lora

    return {name: {"name": name, "id": seed, "path": str(make_tiny_lora(gemma2_model, e2e_dir / f"lora-{SHAPE}-{name}", seed))}
            for seed, name in enumerate(("tenant-a", "tenant-b"), start=1)}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def runs(gemma2_model: Path, adapters: dict[str, dict[str, Any]], e2e_dir: Path, redis_url: str) -> dict[str, Any]:
    """The reference (no connector), a writer (CPU tier + Redis) and a fresh reader of the same Redis."""
    work = e2e_dir / f"features-{SHAPE}"
    lora_a, lora_b = adapters["tenant-a"], adapters["tenant-b"]
    env = {**cache_env(None), "LMCACHE_REMOTE_URL": redis_url, "LMCACHE_LOOKUP_TIMEOUT_MS": "2000"}
    # The reference and the writer are independent: side by side.
    first = run_jobs({"reference": ({"model": str(gemma2_model), "connector": False,
                                     "llm_kwargs": {**LORA_KWARGS, "enable_prefix_caching": True}, "phases": [
        gen_phase("docs", prompts(DOCS)), gen_phase("docs_again", prompts(DOCS)),
        gen_phase("salted", prompts([SALTED])),
        gen_phase("lora_a", prompts([SALTED], lora=lora_a)), gen_phase("lora_b", prompts([SALTED], lora=lora_b)),
    ]}, work / "reference"), "writer": ({"model": str(gemma2_model), "connector": True, "env": env,
                                         "llm_kwargs": LORA_KWARGS, "phases": [
        gen_phase("cold", prompts(DOCS)),
        gen_phase("plain", prompts([SALTED])),
        gen_phase("salt_a", prompts([SALTED], salt="tenant-a")),
        gen_phase("salt_b", prompts([SALTED], salt="tenant-b")),
        gen_phase("salt_a_again", prompts([SALTED], salt="tenant-a")),
        gen_phase("lora_a", prompts([SALTED], lora=lora_a)),
        gen_phase("lora_a_again", prompts([SALTED], lora=lora_a)),
        gen_phase("flushed", prompts([DOCS[0][:64]]), before=["flush"]),  # queued Redis writes are in
    ]}, work / "writer")})
    reference, writer = first["reference"], first["writer"]
    reader = run_job({"model": str(gemma2_model), "connector": True, "env": env, "llm_kwargs": LORA_KWARGS, "phases": [
        gen_phase("remote", prompts(DOCS)),
        gen_phase("salt_c", prompts([SALTED], salt="tenant-c")),
        gen_phase("salt_a", prompts([SALTED], salt="tenant-a")),
        gen_phase("lora_b", prompts([SALTED], lora=lora_b)),
        gen_phase("lora_a", prompts([SALTED], lora=lora_a)),
    ]}, work / "reader")
    return {"work": work, "reference": reference, "writer": writer, "reader": reader}


def log_of(work: Path) -> str:
    return (work / "stderr.txt").read_text() + (work / "stdout.txt").read_text()


def loads_of(hit_tokens: list[int]) -> int:
    return sum(chunks_loaded_per_hit(GROUPS, h) for h in hit_tokens)


def test_every_job_keeps_the_hybrid_manager(runs: dict[str, Any]) -> None:
    for job in ("reference", "writer", "reader"):
        assert HMA_OFF_LINE not in log_of(runs["work"] / job), f"{job}: vLLM switched the hybrid manager off"


def test_fresh_process_loads_windows_from_redis(runs: dict[str, Any]) -> None:
    assert phase(runs["writer"], "flushed")["counters"]["engine.remote_puts_stored"] > 0
    # With LoRA on, a cold pass with and without the connector differs by up to ~2e-5 in float32 logprobs.
    assert_same_outputs(phase(runs["writer"], "cold"), phase(runs["reference"], "docs"), logprob_atol=1e-4)
    remote = phase(runs["reader"], "remote")
    # Remote lookups answer "not yet" first: other batches than the reference, float32 logprobs move ~1e-5.
    assert_same_outputs(remote, phase(runs["reference"], "docs_again"), logprob_atol=1e-4)
    hits = [expected_hit_tokens(len(d)) for d in DOCS]
    assert [o["num_cached_tokens"] for o in remote["outputs"]] == hits
    delta = remote["delta"]
    assert delta["worker.num_load_faults"] == 0
    # The windowed group reads only its last window's chunks: fewer than twice the full group's.
    assert delta["worker.num_chunks_loaded"] == loads_of(hits) < 2 * sum(hits) // CHUNK_TOKENS
    assert delta["engine.redis_loaded_tokens"] == loads_of(hits) * CHUNK_TOKENS
    assert delta.get("engine.cpu_loaded_tokens", 0) == 0  # nothing from the (empty) CPU tier


def test_another_cache_salt_is_a_miss_and_the_same_salt_hits(runs: dict[str, Any]) -> None:
    ref = phase(runs["reference"], "salted")
    writer, reader = runs["writer"], runs["reader"]
    for run, name in ((writer, "salt_a"), (writer, "salt_b"), (reader, "salt_c")):
        got = phase(run, name)
        assert_same_outputs(got, ref)
        assert got["outputs"][0]["num_cached_tokens"] == 0, name  # the unsalted / other-salt chunks are there
        assert got["delta"].get("worker.num_chunks_loaded", 0) == 0, name
    for run, name in ((writer, "salt_a_again"), (reader, "salt_a")):
        got = phase(run, name)
        assert_same_outputs(got, ref, logprob_atol=1e-4)  # split at the hit: float32 moves by ~1e-5
        assert got["outputs"][0]["num_cached_tokens"] == SALTED_HIT, name
        assert got["delta"]["worker.num_chunks_loaded"] == loads_of([SALTED_HIT]), name


def test_another_adapter_is_a_miss_and_the_same_adapter_hits(runs: dict[str, Any]) -> None:
    ref_a, ref_b = phase(runs["reference"], "lora_a"), phase(runs["reference"], "lora_b")
    base = phase(runs["reference"], "salted")["outputs"][0]
    assert ref_a["outputs"][0]["tokens"] != base["tokens"] != ref_b["outputs"][0]["tokens"]  # adapters act
    writer, reader = runs["writer"], runs["reader"]
    for run, name, ref in ((writer, "lora_a", ref_a), (reader, "lora_b", ref_b)):
        got = phase(run, name)
        assert_same_outputs(got, ref)
        assert got["outputs"][0]["num_cached_tokens"] == 0, name  # the base model's chunks are there
        assert got["delta"].get("worker.num_chunks_loaded", 0) == 0, name
    for run, name in ((writer, "lora_a_again"), (reader, "lora_a")):
        got = phase(run, name)
        assert_same_outputs(got, ref_a, logprob_atol=1e-4)
        assert got["outputs"][0]["num_cached_tokens"] == SALTED_HIT, name
        assert got["delta"]["worker.num_chunks_loaded"] == loads_of([SALTED_HIT]), name


@pytest.fixture(scope="module")
def tp_run(gemma2_model: Path, e2e_dir: Path) -> dict[str, Any]:
    work = e2e_dir / f"features-{SHAPE}" / "tp2"
    # vLLM CPU needs the threads bound by hand for TP=2 on one NUMA node: one core per rank.
    result = run_job({"model": str(gemma2_model), "connector": True, "env": {**cache_env(None), "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                      "llm_kwargs": {"tensor_parallel_size": 2},
                      "phases": [gen_phase("cold", prompts(TP_DOCS)), gen_phase("warm", prompts(TP_DOCS))]}, work)
    return {"work": work, **result}


@pytest.mark.slow
def test_tp2_both_ranks_store_both_groups_and_hit(runs: dict[str, Any], tp_run: dict[str, Any]) -> None:
    assert HMA_OFF_LINE not in log_of(tp_run["work"])
    cold, warm = phase(tp_run, "cold"), phase(tp_run, "warm")
    hits = [expected_hit_tokens(len(d)) for d in TP_DOCS]
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == hits
    assert warm["delta"]["scheduler.num_load_tokens"] == sum(hits)
    # Workers run in their own processes: the placement directory holds both ranks' chunks of both groups.
    assert cold["delta"]["scheduler.placed_digests"] == 2 * len(GROUPS) * sum(len(d) // CHUNK_TOKENS for d in TP_DOCS)
    # TP=2 all-reduces in another order than TP=1 (and runs without LoRA): same tokens, logprobs within 1e-4.
    tp1 = {"outputs": phase(runs["reference"], "docs")["outputs"][: len(TP_DOCS)]}
    assert_same_outputs(cold, tp1, logprob_atol=1e-4)
    assert_same_outputs(warm, cold, logprob_atol=1e-4)
