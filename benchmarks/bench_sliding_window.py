"""Sliding-window models: what a cache hit loads and costs, with vLLM's hybrid KV cache manager on and off.

Runs as a script (``python benchmarks/bench_sliding_window.py [--shapes mistral-7m gemma2-7m]``): per
tiny float32 model shape (``lmi_cache.devtools.tiny_model``), one vLLM (CPU) process per configuration,
run one after the other in child processes of this script, then one markdown table:

1. ours, hybrid manager on:  our connector (CPU tier, vLLM prefix caching off: every hit is ours);
   sliding-window layers load only the window before the hit.
2. ours, hybrid manager off: the same connector with ``disable_hybrid_kv_cache_manager=True``, the
   mode vLLM forces on a connector without hybrid support: every layer loads the whole prefix.
3. vLLM prefix cache:        no connector, vLLM's own prefix cache (nothing is loaded: the KV stays in
   vLLM's memory).

Each child sends every document once (cold: the cache fills), then again (warm: hits), one request at a
time with one output token, so the warm time is the hit's time to first token. Bytes loaded per hit come
from the connector's worker counter ``load_bytes``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = ("ours-hma", "ours-no-hma", "vllm-prefix")
VOCAB_LOW, VOCAB_HIGH = 10, 4000


def documents(num: int, tokens: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(tokens)] for _ in range(num)]


def child(job: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process: start vLLM, cold pass, warm pass; returns the measurements."""
    os.environ.update(job["env"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.inputs import TokensPrompt

    config = job["config"]
    kwargs: dict[str, Any] = {"model": job["model"], "dtype": "float32", "enforce_eager": True, "seed": 0,
                              "max_model_len": 8192, "enable_prefix_caching": config == "vllm-prefix"}
    if config != "vllm-prefix":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LmiCacheConnector", kv_connector_module_path="lmi_cache.vllm_connector", kv_role="kv_both")
    if config == "ours-no-hma":
        kwargs["disable_hybrid_kv_cache_manager"] = True
    llm = LLM(**kwargs)
    hma_on = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    worker = getattr(get_kv_transfer_group(), "worker_side", None) if has_kv_transfer_group() else None
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def one_pass() -> tuple[list[float], list[int]]:
        seconds, cached = [], []
        for doc in job["documents"]:
            started = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False)[0]
            seconds.append(time.perf_counter() - started)
            cached.append(int(out.num_cached_tokens or 0))
        return seconds, cached

    cold_s, _ = one_pass()
    if worker is not None and worker.engine is not None:
        worker.engine.flush(60.0)
    loaded_before = worker.stats.load_bytes if worker is not None else 0
    warm_s, cached = one_pass()
    loaded = (worker.stats.load_bytes - loaded_before) if worker is not None else 0
    return {"config": config, "hma_on": hma_on, "cold_s": cold_s, "warm_s": warm_s, "hit_tokens": cached,
            "load_bytes_per_hit": loaded / max(1, len(job["documents"]))}


def run_child(job: dict[str, Any], work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    (work / "rpc").mkdir(exist_ok=True)
    job_path = work / "job.json"
    job_path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
                "VLLM_RPC_BASE_PATH": str(work / "rpc")})
    proc = subprocess.run([sys.executable, __file__, "--child", str(job_path)], env=env, capture_output=True,
                          text=True, timeout=900)
    (work / "stderr.txt").write_text(proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT_JSON:"):
            return json.loads(line.removeprefix("RESULT_JSON:"))
    raise SystemExit(f"bench_sliding_window: the {job['config']} run failed (exit {proc.returncode}); "
                     f"its log is {work / 'stderr.txt'}")


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["| model | configuration | hybrid manager | hit tokens | KiB loaded per hit | cold TTFT (median) "
             "| hit TTFT (median) |", "|---|---|---|---|---|---|---|"]
    for shape, r in rows:
        loaded = "0 (in vLLM's memory)" if r["config"] == "vllm-prefix" else f"{r['load_bytes_per_hit'] / 1024:,.0f}"
        lines.append(f"| {shape} | {r['config']} | {'on' if r['hma_on'] else 'off'} | "
                     f"{statistics.median(r['hit_tokens']):,.0f} | {loaded} | {statistics.median(r['cold_s']) * 1e3:.1f} ms | "
                     f"{statistics.median(r['warm_s']) * 1e3:.1f} ms |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["mistral-7m", "gemma2-7m"])
    parser.add_argument("--num-documents", type=int, default=6)
    parser.add_argument("--document-tokens", type=int, default=4160, help="4096 reusable + 64 to compute")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(json.loads(Path(args.child).read_text()))
        sys.stdout.write("RESULT_JSON:" + json.dumps(result) + "\n")
        sys.stdout.flush()
        os._exit(0)  # vLLM's shutdown can hang on CPU; the result is out
    from lmi_cache.devtools.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-sliding-"))
    docs = documents(args.num_documents, args.document_tokens)
    rows = []
    for shape in args.shapes:
        model = make_tiny_model(work / f"model-{shape}", shape)
        for config in args.configs:
            env = {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "true", "LMCACHE_MAX_LOCAL_CPU_SIZE": "2"}
            job = {"model": str(model), "config": config, "documents": docs, "env": env}
            rows.append((shape, run_child(job, work / f"{shape}-{config}")))
            print(f"{shape} {config}: done", file=sys.stderr, flush=True)
    (work / "results.json").write_text(json.dumps([{"shape": shape, **r} for shape, r in rows], indent=1))
    print(table(rows))
    print(f"\nper-request times: {work / 'results.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
