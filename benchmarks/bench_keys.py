"""Cost of keying one prompt for every rank: a chain per rank against one chain per request (run by hand; test-free).

The scheduler needs every rank's key of every chunk. Before the key space, it
chained the whole prompt once per rank (the rank was in the seed); now it
chains once and derives each rank's key with one short hash per chunk. Both are
timed side by side in one run, interleaved, best of ``--repeats``, on a Python
list of token ids (what vLLM hands the scheduler). Usage::

    .venv/bin/python benchmarks/bench_keys.py                 # 32k tokens, TP 8, 256-token chunks
    .venv/bin/python benchmarks/bench_keys.py --tokens 131072 --tp 4
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmi_cache.keys.hashing import KeyNamespace, KeySpace, chunk_keys  # noqa: E402

MODEL, DTYPE, LAYOUT = "bench-model", "bfloat16", "cpu.s0123.bfloat16"


def per_rank_chains(tokens: list[int], tp: int, chunk: int) -> list[tuple[object, ...]]:
    """What the scheduler did before: one full chain per rank, then transposed to chunk-major."""
    per_rank = [chunk_keys(tokens, KeyNamespace(MODEL, DTYPE, LAYOUT, tp_rank=r, tp_size=tp), chunk) for r in range(tp)]
    return [tuple(keys) for keys in zip(*per_rank)]


def interleaved_best(repeats: int, fns: list[Callable[[], object]]) -> list[float]:
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768, help="prompt length in tokens (default 32768)")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks (default 8)")
    parser.add_argument("--chunk", type=int, default=256, help="chunk size in tokens (default 256)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs of each, best kept (default 30)")
    args = parser.parse_args()
    if min(args.tokens, args.tp, args.chunk, args.repeats) <= 0:
        sys.exit("bench_keys: --tokens, --tp, --chunk and --repeats must be positive")
    tokens = np.random.default_rng(0).integers(0, 150_000, args.tokens).tolist()
    space = KeySpace(MODEL, DTYPE, LAYOUT, args.chunk, tp_size=args.tp)
    old_s, new_s = interleaved_best(args.repeats, [
        lambda: per_rank_chains(tokens, args.tp, args.chunk),
        lambda: space.for_request(tokens),
    ])
    num_chunks = args.tokens // args.chunk
    print(f"keys for a {args.tokens}-token prompt, TP {args.tp}, {args.chunk}-token chunks "
          f"({num_chunks} chunks x {args.tp} ranks), best of {args.repeats}:")
    print(f"  one chain per rank (before)   {old_s * 1e3:8.3f} ms")
    print(f"  one chain per request (now)   {new_s * 1e3:8.3f} ms")
    print(f"  speed-up                      {old_s / new_s:8.2f}x")


if __name__ == "__main__":
    main()
