"""Where a blend's time goes: each piece of every measured blend, timed inside one vLLM process.

The RAG prompts of ``bench_blend_rag.py`` (same seeds), served by one in-process vLLM
with the blending connector. After the warm-up, each measured prompt is blended and
this prints, per prompt, its TTFT and the milliseconds (and minor page faults) spent in
each piece of the blend: layer 0's attention (``attend_layer0_cross`` to what precedes
each document and ``layer0_merge`` with its stored part; ``attend_dense`` vLLM's kernel
over every token without it), the recomputed tokens' attention (``attend_scattered``
native, ``attend_vllm_runs`` vLLM's kernel),
projections and MLP (``qkv``, ``finish_rows``), re-rotation, KV writes, selection. At
the end, glibc's heap (``mallinfo2``). A profile, not a benchmark: the timers are
wrappers around the blender's functions.

    .venv/bin/python benchmarks/profile_blend.py                         # 32M, 6 prompts
    .venv/bin/python benchmarks/profile_blend.py --paired                # each prompt also served with no cache and prefix-only
    .venv/bin/python benchmarks/profile_blend.py --paired --prewarm-mib 255   # a smaller heap prewarm (0: none)
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_blend_rag  # noqa: E402  (benchmarks/, beside this script)

SECONDS: collections.Counter[str] = collections.Counter()
FAULTS: collections.Counter[str] = collections.Counter()


def _timed(name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            piece = name(*args, **kwargs) if callable(name) else name
            SECONDS[piece] += time.perf_counter() - started
            FAULTS[piece] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    return wrapper


def _instrument(prewarm_mib: int | None) -> None:
    from lmi_cache.blend import blender, host_heap, worker_jobs
    from lmi_cache.vllm_connector import blend_model as vllm_model, cpu_paged_attention

    blender.rerotated_segments = _timed("rerotate", blender.rerotated_segments)
    blender._select = _timed("select", blender._select)
    blender.finish_rows = _timed("finish_rows", blender.finish_rows)
    blender.rotate_qk = _timed("rotate_qk", blender.rotate_qk)
    vllm_model.VllmLayerwiseModel.qkv = _timed("qkv", vllm_model.VllmLayerwiseModel.qkv)
    paged = cpu_paged_attention.CpuPagedAttention
    paged.write = _timed("kv_write", paged.write)
    paged.attend_scattered = _timed("attend_scattered", paged.attend_scattered)
    paged.attend_with_lse = _timed("attend_layer0_cross", paged.attend_with_lse)
    blender.merge_attention = _timed("layer0_merge", blender.merge_attention)
    # vLLM's kernel: one run of positions is a dense layer; several are scattered tokens as runs.
    paged.attend = _timed(lambda self, layer, q, positions: "attend_dense" if _one_run(positions) else "attend_vllm_runs",
                          paged.attend)
    worker_jobs.BlendWorker._blend_one = _timed("blend (all)", worker_jobs.BlendWorker._blend_one)
    if prewarm_mib is not None:  # the connector imports these when it registers the KV caches
        host_heap.blend_heap_bytes = lambda *args: prewarm_mib << 20
        if prewarm_mib == 0:
            host_heap.prewarm_heap = lambda num_bytes: False


def _one_run(positions: Any) -> bool:
    return int(positions[-1]) - int(positions[0]) == positions.numel() - 1


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_line() -> str:
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return "heap: mallinfo2 unavailable (not glibc 2.33+)"
    return (f"heap: arena {info.arena >> 20} MiB (in use {info.uordblks >> 20}, free {info.fordblks >> 20}), "
            f"mmapped blocks {info.hblkhd >> 20} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="32m", choices=("7m", "32m", *bench_blend_rag.DEEP_MODELS))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--paired", action="store_true",
                        help="serve each prompt after its blend with no cache and prefix-only too (as --paired does)")
    parser.add_argument("--prewarm-mib", type=int, default=None,
                        help="heap prewarm in MiB instead of the connector's own sizing (0: none)")
    args = parser.parse_args()
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "true",
                       "LMCACHE_MAX_LOCAL_CPU_SIZE": "6", "LMCACHE_ENABLE_BLENDING": "true"})
    from lmi_cache.vllm_connector import plugin as vllm_plugin
    from lmi_cache.devtools.tiny_model import make_tiny_model

    work = Path(os.environ.get("LMI_CACHE_BENCH_MODEL_DIR", "/tmp/lmi-cache-bench-models"))
    if args.size in bench_blend_rag.DEEP_MODELS:
        model = bench_blend_rag._deep_model(work / args.size, args.size, make_tiny_model(work / "tiny-7m", "7m"))
    else:
        model = make_tiny_model(work / f"tiny-{args.size}", args.size)
    build = argparse.Namespace(seed=0, system_tokens=64, doc_tokens=2000, pool=8, docs=4, question_tokens=32,
                               prompts=args.prompts)
    warmup, prompts = bench_blend_rag._build(build, bench_blend_rag._separator(model))
    _instrument(args.prewarm_mib)
    vllm_plugin.register()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=True,
              max_model_len=max(len(p) for p in warmup + prompts) + 16,
              kv_transfer_config=KVTransferConfig(kv_connector="LmiCacheConnector",
                                                  kv_connector_module_path="lmi_cache.vllm_connector",
                                                  kv_role="kv_both"))
    blend = SamplingParams(temperature=0.0, max_tokens=1)
    exact = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"blend": False}})
    for tokens in warmup:
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], blend, use_tqdm=False)
    for number, tokens in enumerate(prompts):
        SECONDS.clear()
        FAULTS.clear()
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], blend, use_tqdm=False)
        ttft = time.perf_counter() - started
        pieces = ", ".join(f"{name} {1000 * s:.0f} ms/{FAULTS[name]} faults" for name, s in SECONDS.most_common())
        print(f"prompt {number}: TTFT {1000 * ttft:.0f} ms; {pieces}", flush=True)
        if args.paired:
            salted = TokensPrompt(prompt_token_ids=tokens)
            salted["cache_salt"] = f"profile-no-cache-{number}"
            llm.generate([salted], exact, use_tqdm=False)
            llm.generate([TokensPrompt(prompt_token_ids=tokens)], exact, use_tqdm=False)
    print(_heap_line(), flush=True)
    os._exit(0)  # vLLM's in-process engine can hang on interpreter exit


if __name__ == "__main__":
    main()
