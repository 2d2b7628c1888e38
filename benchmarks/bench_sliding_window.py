"""Sliding-window models: what a cache hit loads and costs, with vLLM's hybrid KV cache manager on and off.

Runs as a script (``python benchmarks/bench_sliding_window.py [--shapes mistral-7m gemma2-7m]``): per
tiny float32 model shape (``lmi_cache.devtools.tiny_model``), one vLLM (CPU) process per configuration,
run one after the other in child processes of this script, then one markdown table:

1. ``ours-hma``: our connector (CPU tier) with the hybrid manager on; sliding-window layers load only
   the window before the hit.
2. ``ours-no-hma``: the same connector with ``disable_hybrid_kv_cache_manager=True``, the mode vLLM
   forces on a connector without hybrid support: every layer loads the whole prefix.

Both run with vLLM's own prefix cache on as well. After two warm-up requests, each document is sent
three times in a row, one request at a time with one output token (so each time is a time to first
token): cold (nothing cached), again (a hit in vLLM's own prefix cache: nothing is loaded), and, after
``reset_prefix_cache()`` made vLLM forget it, a third time (our connector's hit from the CPU tier).
The three sends of a document run back to back in one process, so vLLM's hit and ours are compared
under the same load; hits of a few dozen computed tokens are short enough that other processes on a
shared machine can multiply them between runs. Bytes loaded per hit come from the connector's worker
counter ``load_bytes``.
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

CONFIGS = ("ours-hma", "ours-no-hma")
VOCAB_LOW, VOCAB_HIGH = 10, 4000


def documents(num: int, tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(tokens)] for _ in range(num)]


def child(job: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process: start vLLM, then per document cold / vLLM's hit / our hit."""
    os.environ.update(job["env"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=8192,
              enable_prefix_caching=True, disable_hybrid_kv_cache_manager=job["config"] == "ours-no-hma",
              kv_transfer_config=KVTransferConfig(kv_connector="LmiCacheConnector",
                                                  kv_connector_module_path="lmi_cache.vllm_connector",
                                                  kv_role="kv_both"))
    hma_on = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    worker = get_kv_transfer_group().worker_side  # type: ignore[attr-defined]  # our LmiCacheConnector
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def send(doc: list[int]) -> tuple[float, int]:
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False)[0]
        return time.perf_counter() - started, int(out.num_cached_tokens or 0)

    # vLLM's first prefill of a length pays one-off costs (allocator growth, kernel set-up): not a cold prefill.
    for doc in documents(2, len(job["documents"][0]), seed=1):
        send(doc)
    llm.reset_prefix_cache()
    result: dict[str, Any] = {"config": job["config"], "hma_on": hma_on, "cold_s": [], "vllm_hit_s": [],
                              "ours_hit_s": [], "hit_tokens": [], "load_bytes": []}
    # The three sends of a document follow each other, so that another process's load on a shared
    # machine lands on all three alike instead of on whichever configuration ran at that moment.
    for doc in job["documents"]:
        result["cold_s"].append(send(doc)[0])
        seconds, vllm_hit = send(doc)  # vLLM's own prefix cache: nothing is loaded
        result["vllm_hit_s"].append(seconds)
        llm.reset_prefix_cache()  # forget vLLM's copy: the next send is our connector's hit
        worker.engine.flush(60.0)
        loaded_before = worker.stats.load_bytes
        seconds, ours_hit = send(doc)
        result["ours_hit_s"].append(seconds)
        result["load_bytes"].append(worker.stats.load_bytes - loaded_before)
        if vllm_hit != ours_hit:
            raise RuntimeError(f"vLLM's prefix cache hit {vllm_hit} tokens, the connector {ours_hit}")
        result["hit_tokens"].append(ours_hit)
        llm.reset_prefix_cache()
    return result


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
    lines = ["| model | hybrid manager | hit tokens | KiB loaded per hit | cold TTFT | vLLM prefix-cache hit TTFT "
             "| lmi-cache hit TTFT |", "|---|---|---|---|---|---|---|"]
    for shape, r in rows:
        ms = {key: f"{statistics.median(r[key]) * 1e3:.1f} ms" for key in ("cold_s", "vllm_hit_s", "ours_hit_s")}
        lines.append(f"| {shape} | {'on' if r['hma_on'] else 'off'} | {statistics.median(r['hit_tokens']):,.0f} | "
                     f"{statistics.median(r['load_bytes']) / 1024:,.0f} | {ms['cold_s']} | {ms['vllm_hit_s']} | "
                     f"{ms['ours_hit_s']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["mistral-7m", "gemma2-7m"],
                        help="tiny model shapes; 7m is the full-attention Llama, for comparison")
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
