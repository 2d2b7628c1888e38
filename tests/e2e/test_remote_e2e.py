"""Two vLLM processes share one remote store: what the first prefilled, the second loads (Redis, and S3).

The second process of each pair has an empty CPU tier and no disk tier, so
every hit comes from the store; its outputs must equal a server without any
cache. Then every value in Redis is damaged: the second process still
answers exactly as without a cache (each damaged value is a miss). The Redis
and the S3 pair run side by side (two vLLM processes at a time) to keep the
module's wall time down where there are cores for it.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import DOCS, SALTED, assert_same_outputs, cache_env, expected_hit_tokens, gen_phase, phase, prompts, run_job

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lmi_cache"))
from remote_fixtures import BUCKET, moto_s3  # noqa: E402,F401

from lmi_cache.devtools.redis_server import RedisServer  # noqa: E402

S3_DOCS = DOCS[:3]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def writer_job(model: Path, env: dict[str, str], docs: list[list[int]], salted: bool) -> dict[str, Any]:
    phases = [gen_phase("cold", prompts(docs))]
    if salted:
        phases.append(gen_phase("salted", prompts([SALTED], salt="tenant-a")))
    phases.append(gen_phase("flushed", prompts([docs[0][:64]]), before=["flush"]))  # queued stores written
    return {"model": str(model), "connector": True, "env": env, "phases": phases}


def remote_env(url: str, **extra: str) -> dict[str, str]:
    env = cache_env(None)
    env.update({"LMCACHE_REMOTE_URL": url, "LMCACHE_LOOKUP_TIMEOUT_MS": "2000"})
    if extra:
        import json

        env["LMCACHE_EXTRA_CONFIG"] = json.dumps(extra)
    return env


@pytest.fixture(scope="module")
def fleet_runs(tiny_model: Path, e2e_dir: Path, redis_url: str, moto_s3: str) -> dict[str, dict[str, Any]]:
    from concurrent.futures import ThreadPoolExecutor

    redis_env = remote_env(redis_url, remote_compression="zstd-planes")
    s3_env = remote_env(f"s3://{BUCKET}/e2e", s3_endpoint_url=moto_s3, s3_region="us-east-1")
    readers = {
        "redis": {"model": str(tiny_model), "connector": True, "env": redis_env, "phases": [
            gen_phase("remote", prompts(DOCS)),
            gen_phase("corrupt", prompts([SALTED], salt="tenant-a"), before=["corrupt_remote"]),
        ]},
        "s3": {"model": str(tiny_model), "connector": True, "env": s3_env,
               "phases": [gen_phase("remote", prompts(S3_DOCS))]},
    }
    with ThreadPoolExecutor(2) as pool:
        writers = {
            "redis-1": pool.submit(run_job, writer_job(tiny_model, redis_env, DOCS, salted=True), e2e_dir / "redis-1"),
            "s3-1": pool.submit(run_job, writer_job(tiny_model, s3_env, S3_DOCS, salted=False), e2e_dir / "s3-1"),
        }
        runs = {name: future.result() for name, future in writers.items()}
        second = {f"{name}-2": pool.submit(run_job, job, e2e_dir / f"{name}-2") for name, job in readers.items()}
        runs.update({name: future.result() for name, future in second.items()})
    return runs


def test_second_server_loads_from_redis(baseline: dict[str, Any], fleet_runs: dict[str, dict[str, Any]]) -> None:
    assert phase(fleet_runs["redis-1"], "flushed")["counters"]["engine.remote_puts_stored"] > 0
    remote = phase(fleet_runs["redis-2"], "remote")
    # The lookups answer "not yet" first, so requests start in other steps and batches than the
    # reference; vLLM CPU's float32 logprobs move by ~1e-5 with batch composition (no cache involved).
    assert_same_outputs(remote, phase(baseline, "docs_again"), logprob_atol=1e-4)
    assert [o["num_cached_tokens"] for o in remote["outputs"]] == [expected_hit_tokens(len(d)) for d in DOCS]
    delta = remote["delta"]
    assert delta["worker.num_load_faults"] == 0
    assert delta["engine.redis_loaded_tokens"] == sum(expected_hit_tokens(len(d)) for d in DOCS)
    assert delta.get("engine.cpu_loaded_tokens", 0) == 0  # nothing came from the (empty) CPU tier
    assert delta["scheduler.num_remote_hit_chunks"] == sum(expected_hit_tokens(len(d)) for d in DOCS) // 256


def test_damaged_redis_values_are_misses(baseline: dict[str, Any], fleet_runs: dict[str, dict[str, Any]]) -> None:
    corrupt = phase(fleet_runs["redis-2"], "corrupt")
    assert_same_outputs(corrupt, phase(baseline, "salted"))
    assert corrupt["delta"]["worker.num_load_faults"] > 0
    assert corrupt["delta"].get("engine.redis_loaded_tokens", 0) == 0


def test_second_server_loads_from_s3(baseline: dict[str, Any], fleet_runs: dict[str, dict[str, Any]]) -> None:
    assert phase(fleet_runs["s3-1"], "flushed")["counters"]["engine.remote_puts_stored"] > 0
    remote = phase(fleet_runs["s3-2"], "remote")
    want = phase(baseline, "docs_again")
    # Another batch than the reference (3 prompts, not 8): vLLM CPU float32 logprobs move by ~1e-5 with it.
    assert_same_outputs(remote, {"outputs": want["outputs"][: len(S3_DOCS)]}, logprob_atol=1e-4)
    assert [o["num_cached_tokens"] for o in remote["outputs"]] == [expected_hit_tokens(len(d)) for d in S3_DOCS]
    assert remote["delta"]["engine.s3_loaded_tokens"] == sum(expected_hit_tokens(len(d)) for d in S3_DOCS)
    assert remote["delta"]["worker.num_load_faults"] == 0
