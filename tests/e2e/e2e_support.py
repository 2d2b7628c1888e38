"""Helpers of the end-to-end tests: prompts, cache env, and running vLLM jobs (test process).

Each vLLM start costs 15-40 s on a 2-core machine, so a job (one
``run_llm.py`` subprocess) runs many phases, fixtures share job results
between the test functions that check them, jobs that several modules read
are shared (``shared_jobs.py``), and up to ``SLOTS`` jobs run at once.
"""
from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmi_cache.keys.kv_groups import KvCacheGroup
from vllm_cache import LEAN_VLLM_ENV, vllm_cache_root
from warm_start import run_script

RUN_LLM = Path(__file__).with_name("run_llm.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNK_TOKENS = 256  # two vLLM CPU blocks of 128
BLOCK_TOKENS = 128  # vLLM CPU's block size
VOCAB_LOW, VOCAB_HIGH = 10, 4000
MAX_TOKENS, LOGPROBS = 8, 2
# vLLM logs this when it switches its hybrid KV cache manager off for a connector without SupportsHMA.
HMA_OFF_LINE = "Turning off hybrid kv cache manager"


def random_tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


# Lengths in (256k, 256k + 128]: our chunk-aligned hit then equals vLLM's own block-aligned
# prefix-cache hit, so the reference run (vLLM prefix caching on) splits each warm prompt at
# the same token and float32 outputs can be compared bit for bit.
DOC_LENGTHS = (640, 600, 850, 1050, 1100, 520, 800, 1300)
DOCS = [random_tokens(seed, n) for seed, n in enumerate(DOC_LENGTHS, start=1)]
# Share 600, 300 and 100 leading tokens with DOCS[0..2], then diverge.
PARTIAL_SHARED_TOKENS = (600, 300, 100)
PARTIAL = [
    DOCS[0][:600] + random_tokens(101, 200),
    DOCS[1][:300] + random_tokens(102, 150),
    DOCS[2][:100] + random_tokens(103, 400),
]
SALTED = random_tokens(200, 700)
# 3 blocks and 1 full chunk each; 6 of them decoding PREEMPT_MAX_TOKENS tokens outgrow a
# 16-block KV cache (each needs a 4th block after 24 tokens), so vLLM must preempt.
PREEMPT = [random_tokens(300 + i, 360) for i in range(6)]
PREEMPT_MAX_TOKENS = 48


def prompts(items: list[list[int]], salt: str | None = None, lora: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Token prompts of a phase; ``lora`` is ``{"name", "id", "path"}`` of an adapter (run_llm.py's LoRARequest)."""
    return [{"tokens": tokens, "salt": salt, "lora": lora} for tokens in items]


def expected_hit_tokens(num_tokens: int, shared_tokens: int | None = None) -> int:
    """Leading full chunks held, capped to leave one token to compute, aligned down to a block."""
    shared = num_tokens if shared_tokens is None else shared_tokens
    held = (shared // CHUNK_TOKENS) * CHUNK_TOKENS
    cap = ((num_tokens - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
    return min(held, cap)


def window_groups(shape: str) -> list[KvCacheGroup]:
    """The KV cache groups vLLM builds for a tiny sliding-window shape (lmi_cache.devtools.tiny_model)."""
    return {"mistral-7m": [KvCacheGroup(0, (), 320)], "gemma2-7m": [KvCacheGroup(0, (), 256), KvCacheGroup(1, ())]}[shape]


def chunks_loaded_per_hit(groups: list[KvCacheGroup], hit_tokens: int) -> int:
    """Chunks a hit at ``hit_tokens`` reads: every chunk for full groups, the window's chunks for sliding ones."""
    end = -(-hit_tokens // CHUNK_TOKENS)
    return sum(end - g.first_needed_block(hit_tokens, BLOCK_TOKENS) * BLOCK_TOKENS // CHUNK_TOKENS for g in groups)


def gen_phase(
    name: str, items: list[dict[str, Any]], before: list[str] | None = None, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    return {"name": name, "prompts": items, "before": before or [], "max_tokens": max_tokens, "logprobs": LOGPROBS}


def cache_env(disk_dir: Path | None, cpu_gib: float = 1.0) -> dict[str, str]:
    env = {"LMCACHE_CHUNK_SIZE": str(CHUNK_TOKENS), "LMCACHE_LOCAL_CPU": "true", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(cpu_gib)}
    if disk_dir is not None:
        env.update({"LMCACHE_LOCAL_DISK": f"file://{disk_dir}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"})
    return env


# vLLM processes that run at once in this process (LMI_CACHE_E2E_JOBS): much of a start is on one core
# (model load, profiling), so two overlap well on two cores. Under pytest-xdist the e2e tests are two
# groups in two workers (tests/e2e_groups.py), whose one job each already fill two cores: 1 there, 2 alone.
SLOTS = max(1, int(os.environ.get("LMI_CACHE_E2E_JOBS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")))
_free = SLOTS
_slots_changed = threading.Condition()


@contextmanager
def job_slot(whole_machine: bool = False) -> Iterator[None]:
    """Hold one slot while a vLLM process runs; ``whole_machine`` (a job that binds every core: TP or DP) holds all."""
    need = SLOTS if whole_machine else 1
    global _free
    with _slots_changed:
        _slots_changed.wait_for(lambda: _free >= need)
        _free -= need
    try:
        yield
    finally:
        with _slots_changed:
            _free += need
            _slots_changed.notify_all()


class JobFailed(AssertionError):
    """A run_llm.py subprocess failed; carries its output."""

    def __init__(self, returncode: int, output: str) -> None:
        super().__init__(f"run_llm.py exited {returncode}:\n{output[-6000:]}")
        self.returncode = returncode
        self.output = output


def job_env(work_dir: Path, *paths: Path) -> dict[str, str]:
    """A vLLM job's environment: the caller's without LMCACHE_ settings, vLLM's scratch under ``work_dir``, the
    engine core in the job's process (``LEAN_VLLM_ENV``), and the checkout (then ``paths``)
    first on PYTHONPATH."""
    (work_dir / "rpc").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CACHE_ROOT": vllm_cache_root(work_dir),
            "VLLM_RPC_BASE_PATH": str(work_dir / "rpc"),
            **LEAN_VLLM_ENV,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), *map(str, paths), env.get("PYTHONPATH", "")) if p),
        }
    )
    return env


def run_job(job: dict[str, Any], work_dir: Path, timeout_s: float = 420.0) -> dict[str, Any]:
    """Run one vLLM job in a fresh process (forked from the warm forkserver: ``warm_start``), return its results."""
    env = job_env(work_dir)
    job_path = work_dir / "job.json"
    job_path.write_text(json.dumps(job))
    kwargs = job.get("llm_kwargs", {})
    with job_slot(whole_machine=kwargs.get("tensor_parallel_size", 1) > 1 or kwargs.get("data_parallel_size", 1) > 1):
        proc = run_script(RUN_LLM, [str(job_path)], env, work_dir, timeout_s)  # stdout.txt, stderr.txt in work_dir
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT_JSON:"):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT_JSON:"))
            # The placement directory is the only index: a tier refusing what it planned is a bug.
            assert result.get("safety_net_firings", 0) == 0, f"a tier's safety net fired in {work_dir}"
            return result
    raise JobFailed(proc.returncode, proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr)


def run_jobs(jobs: dict[str, tuple[dict[str, Any], Path]]) -> dict[str, dict[str, Any]]:
    """Run independent jobs side by side (as many at once as there are slots): their results by name."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(run_job, job, work_dir) for name, (job, work_dir) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def phase(result: dict[str, Any], name: str) -> dict[str, Any]:
    for item in result["phases"]:
        if item["name"] == name:
            return item
    raise KeyError(name)


def assert_same_outputs(got: dict[str, Any], want: dict[str, Any], logprob_atol: float = 0.0) -> None:
    """Greedy tokens identical and logprobs identical (or within ``logprob_atol``), prompt by prompt."""
    assert len(got["outputs"]) == len(want["outputs"])
    for i, (g, w) in enumerate(zip(got["outputs"], want["outputs"])):
        assert g["tokens"] == w["tokens"], f"prompt {i}: tokens differ"
        if logprob_atol == 0.0:
            assert g["logprobs"] == w["logprobs"], f"prompt {i}: logprobs differ"
            continue
        assert len(g["logprobs"]) == len(w["logprobs"])
        for step, (gs, ws) in enumerate(zip(g["logprobs"], w["logprobs"])):
            assert [t for t, _ in gs] == [t for t, _ in ws], f"prompt {i} step {step}: top tokens differ"
            worst = max(abs(a - b) for (_, a), (_, b) in zip(gs, ws))
            assert worst <= logprob_atol, f"prompt {i} step {step}: logprobs differ by {worst}"
