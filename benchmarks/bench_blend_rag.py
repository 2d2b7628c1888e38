"""RAG time-to-first-token on vLLM CPU: no cache vs prefix caching (vLLM's, ours) vs blending, in one run.

A pool of documents; every prompt is [system prefix | k documents in random order
and combination | question], documents and prefix each ending with the blend
separator. Each configuration gets its own vLLM process (same model, same
prompts, same seeds): a warm-up pass serves prompts that contain every pool
document once (so the caches hold them), then each measured prompt is served
alone with ``max_tokens=1`` and its wall time is its TTFT.

Configurations: ``no_cache`` (no connector, vLLM prefix caching off),
``vllm_prefix`` (vLLM's prefix cache), ``lmi_prefix`` (LmiCacheConnector,
exact prefix chunks), ``blend`` (the connector with blending on, at the configured ratio,
vLLM's prefix cache on). The first generated token of every measured prompt is
compared with ``no_cache`` (greedy agreement; a random-weight model, so only a
sanity check of the blended KV, not a quality figure).

    .venv/bin/python benchmarks/bench_blend_rag.py                 # 4 docs x 2,000 tokens, 32M model
    .venv/bin/python benchmarks/bench_blend_rag.py --size 7m --doc-tokens 1000 --prompts 4

Prints a table and writes JSON with --out.
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

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("no_cache", "vllm_prefix", "lmi_prefix", "blend")


def _child(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    os.environ.update(job["env"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    if job["config"] == "blend":
        from lmi_cache.vllm_connector import plugin as vllm_plugin

        vllm_plugin.register()  # what the installed entry point does in every vLLM process
    kwargs: dict[str, Any] = dict(model=job["model"], dtype="float32", enforce_eager=True, seed=0,
                                  max_model_len=job["max_model_len"],
                                  enable_prefix_caching=job["config"] in ("vllm_prefix", "blend"))
    if job["config"] == "lmi_prefix":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LmiCacheConnector", kv_connector_module_path="lmi_cache.vllm_connector", kv_role="kv_both")
    if job["config"] == "blend":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LmiCacheConnector", kv_connector_module_path="lmi_cache.vllm_connector", kv_role="kv_both")
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    if job.get("paired"):
        _paired(llm, job)
    for tokens in job["warmup"]:  # fills the caches; the last one is a first blend, not timed
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    ttft, first = [], []
    for tokens in job["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        ttft.append(time.perf_counter() - t0)
        first.append(out[0].outputs[0].token_ids[0])
    stats: dict[str, Any] = {}
    if job["config"] == "blend":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        stats = get_kv_transfer_group().blending.worker.stats.snapshot()
    sys.stdout.write("RESULT_JSON:" + json.dumps({"ttft_s": ttft, "first_tokens": first, "blend_stats": stats}) + "\n")
    sys.stdout.flush()
    os._exit(0)


def _paired(llm: Any, job: dict[str, Any]) -> None:
    """One blending vLLM; every prompt served three ways back to back, so machine load hits all alike.

    Order per prompt: blend (blending on), no cache (blending off and a fresh
    ``cache_salt``: neither vLLM's prefix cache nor the chunk cache can hit), prefix only
    (blending off: vLLM's prefix cache and the chunk cache, both exact). Blending goes
    first because the exact run puts the whole prompt into vLLM's prefix cache.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def serve(tokens: list[int], salt: str | None, blend: bool) -> tuple[float, int]:
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salt:
            prompt["cache_salt"] = salt
        params = SamplingParams(temperature=0.0, max_tokens=1,
                                extra_args=None if blend else {"kv_transfer_params": {"blend": False}})
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0, out[0].outputs[0].token_ids[0]

    for tokens in job["warmup"]:
        serve(tokens, None, True)
    rows = []
    for number, tokens in enumerate(job["prompts"]):
        blend_s, blend_tok = serve(tokens, None, True)
        none_s, none_tok = serve(tokens, f"bench-no-cache-{number}", False)
        prefix_s, _ = serve(tokens, None, False)
        rows.append({"blend_s": blend_s, "no_cache_s": none_s, "prefix_s": prefix_s, "same_first": blend_tok == none_tok})
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stats = get_kv_transfer_group().blending.worker.stats.snapshot()
    sys.stdout.write("RESULT_JSON:" + json.dumps({"rows": rows, "blend_stats": stats}) + "\n")
    sys.stdout.flush()
    os._exit(0)


# Deeper models than the devtools' tiny ones: blending recomputes every layer before the check
# layer for all tokens, so its saving grows with depth (a 7-8B model has 32 layers).
DEEP_MODELS: dict[str, dict[str, Any]] = {"deep24": dict(num_hidden_layers=24, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                              intermediate_size=1376)}


def _deep_model(out_dir: Path, size: str, tokenizer_from: Path) -> Path:
    """A random float32 Llama of ``DEEP_MODELS[size]`` with the tiny models' tokenizer (seeded, cached)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in tokenizer_from.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(item, out_dir / item.name)
    config = LlamaConfig(vocab_size=4096, max_position_embeddings=16384, initializer_range=0.12, bos_token_id=1,
                         eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, **DEEP_MODELS[size])
    config.dtype = "float32"
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def _separator(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model)).encode(" # # ", add_special_tokens=False)


def _build(args: argparse.Namespace, sep: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(args.seed)
    vocab = [t for t in range(10, 4000) if t not in sep]
    doc = lambda n: [rng.choice(vocab) for _ in range(n)] + sep  # noqa: E731
    system = doc(args.system_tokens)
    pool = [doc(args.doc_tokens) for _ in range(args.pool)]
    question = lambda: [rng.choice(vocab) for _ in range(args.question_tokens)]  # noqa: E731
    # Warm-up: every pool document appears once (in pool order, k per prompt), then one untimed
    # prompt like the measured ones (first-call costs: kernels, tables, allocations).
    warmup = [system + sum(pool[i : i + args.docs], []) + question() for i in range(0, args.pool, args.docs)]
    warmup.append(system + sum((pool[i] for i in rng.sample(range(args.pool), args.docs)), []) + question())
    prompts = []
    for _ in range(args.prompts):
        chosen = rng.sample(range(args.pool), args.docs)  # random combination, random order
        prompts.append(system + sum((pool[i] for i in chosen), []) + question())
    return warmup, prompts


def _run(config: str, args: argparse.Namespace, model: Path, warmup: list[list[int]], prompts: list[list[int]],
         work: Path) -> dict[str, Any]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_RPC_BASE_PATH": str(work),
           "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "true", "LMCACHE_MAX_LOCAL_CPU_SIZE": "6",
           "LMCACHE_ENABLE_BLENDING": "true" if config == "blend" else "false"}
    if args.ratio is not None:
        env["LMCACHE_BLEND_RECOMPUTE_RATIOS"] = str(args.ratio)
    job = {"config": config, "model": str(model), "env": env, "warmup": warmup, "prompts": prompts,
           "max_model_len": max(len(p) for p in warmup + prompts) + 16, "paired": args.paired}
    job_path = work / f"{config}.json"
    job_path.write_text(json.dumps(job))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, __file__, "--child", str(job_path)], env=child_env, cwd=work,
                          capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT_JSON:"):
            return json.loads(line.removeprefix("RESULT_JSON:"))
    raise SystemExit(f"{config}: vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def _report_paired(res: dict[str, Any], args: argparse.Namespace, prompts: list[list[int]]) -> None:
    rows = res["rows"]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    ratio = lambda a, b: statistics.median(r[a] / r[b] for r in rows)  # noqa: E731
    print(f"\n{args.size} model, paired in one vLLM process: {len(rows)} prompts of {len(prompts[0])} tokens "
          f"([{args.system_tokens} system | {args.docs} x {args.doc_tokens} docs | {args.question_tokens} question]), "
          f"pool {args.pool}\n")
    print("| serving | median TTFT (s) |\n|---|---|")
    print(f"| no cache | {med('no_cache_s'):.3f} |\n| prefix only (vLLM's + ours) | {med('prefix_s'):.3f} |")
    print(f"| blend | {med('blend_s'):.3f} |\n")
    print(f"median per-prompt ratio: no cache / blend = {ratio('no_cache_s', 'blend_s'):.2f}x, "
          f"prefix only / blend = {ratio('prefix_s', 'blend_s'):.2f}x; "
          f"first token as without cache: {sum(r['same_first'] for r in rows)}/{len(rows)}")
    print(f"blend worker: {res['blend_stats']}")
    print(f"machine load (1-minute average) at start and end: {res['load_avg_1min'][0]:.1f}, {res['load_avg_1min'][1]:.1f}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
                                        "paired": res}, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="32m", choices=("7m", "32m", *DEEP_MODELS),
                        help="random model: 7m (4 layers), 32m (8 layers), deep24 (24 layers, 70M)")
    parser.add_argument("--docs", type=int, default=4, help="documents per prompt")
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--pool", type=int, default=8, help="documents in the pool")
    parser.add_argument("--prompts", type=int, default=6, help="measured prompts per configuration")
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=None, help="blend recompute ratio (default: the setting's 0.15)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=2, help="times each configuration is started (rotating)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--paired", action="store_true",
                        help="one blending vLLM serving each prompt as blend / no cache / prefix only, back to back")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    from lmi_cache.devtools.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-blend-rag-"))
    models_dir = Path(os.environ.get("LMI_CACHE_BENCH_MODEL_DIR", str(work)))
    if args.size in DEEP_MODELS:
        model = _deep_model(models_dir / args.size, args.size, make_tiny_model(models_dir / "tiny-7m", "7m"))
    else:
        model = make_tiny_model(models_dir / f"tiny-{args.size}", args.size)
    warmup, prompts = _build(args, _separator(model))
    if args.paired:
        load_before = os.getloadavg()[0]
        res = _run("blend", args, model, warmup, prompts, work)
        # Other jobs on a shared machine slow every row; the paired ratios absorb it, the seconds do not.
        res["load_avg_1min"] = [load_before, os.getloadavg()[0]]
        _report_paired(res, args, prompts)
        return
    results: dict[str, Any] = {}
    # Rounds rotate through the configurations, so load from other processes on a shared
    # machine spreads over all of them instead of biasing one.
    for round_number in range(args.rounds):
        for config in args.configs.split(","):
            res = _run(config, args, model, warmup, prompts, work)
            print(f"round {round_number} {config}: TTFT {[round(t, 3) for t in res['ttft_s']]} s", flush=True)
            if res.get("blend_stats"):
                print(f"  blend worker: {res['blend_stats']}", flush=True)
            merged = results.setdefault(config, {"ttft_s": [], "first_tokens": [], "blend_stats": []})
            merged["ttft_s"] += res["ttft_s"]
            merged["first_tokens"] += res["first_tokens"]
            merged["blend_stats"].append(res.get("blend_stats"))
    base = results.get("no_cache")
    print(f"\n{args.size} model, {args.prompts} prompts x {args.rounds} rounds, {len(prompts[0])} tokens each "
          f"([{args.system_tokens} system | {args.docs} x {args.doc_tokens} docs | {args.question_tokens} question]), "
          f"pool {args.pool}\n")
    print("| configuration | median TTFT (s) | mean TTFT (s) | speed-up vs no cache | first token = no cache |")
    print("|---|---|---|---|---|")
    for config, res in results.items():
        med = statistics.median(res["ttft_s"])
        speedup = f"{statistics.median(base['ttft_s']) / med:.2f}x" if base else "-"
        agree = (f"{sum(a == b for a, b in zip(res['first_tokens'], base['first_tokens']))}/{len(res['first_tokens'])}"
                 if base else "-")
        print(f"| {config} | {med:.3f} | {statistics.mean(res['ttft_s']):.3f} | {speedup} | {agree} |")
    if "blend" in results:
        blend_med = statistics.median(results["blend"]["ttft_s"])
        for other in ("vllm_prefix", "lmi_prefix"):
            if other in results:
                print(f"\nblend vs {other}: {statistics.median(results[other]['ttft_s']) / blend_med:.2f}x lower TTFT")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
                                        "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
