"""Paged KV gather/scatter: native kernels vs the torch path vs a plain copy of the same bytes.

Run: ``.venv/bin/python benchmarks/bench_kernels.py [--threads 1]`` (about 1 min; ``--help``).
On a GPU: ``python benchmarks/bench_kernels.py --device cuda`` (the plain copy
is then a device-to-device copy).

Each row moves one step's worth of chunks (all layers, one call) between a
paged KV cache and contiguous chunk buffers, with block ids in random order,
and reports, measured side by side in the same run (best of interleaved
repeats, warm buffers):

- ``native/plain``: native throughput as a fraction of ``dst.copy_(src)`` of the
  same number of bytes between two contiguous tensors (target >= 0.9 for
  whole-chunk moves);
- ``native/torch``: speed-up of the native kernels over the torch path
  (``index_select``/``index_copy_`` per layer and chunk).

The last two rows repeat the CPU layouts with one call per chunk (a table
built per call), as the connector issues them today.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmi_cache.transfer import kernels  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    num_layers: int
    physical: tuple[int, ...]  # one layer, blocks dim included (given as -1)
    perm: tuple[int, ...]  # physical -> logical
    block_dim: int  # in the logical shape
    dtype: torch.dtype
    blocks_per_chunk: int
    num_chunks: int


# 256-token chunks; vLLM CPU blocks are 128 tokens, GPU blocks 16.
CASES = [
    Case("7M model, vLLM CPU layout, bf16", 4, (-1, 2, 128, 64), (0, 1, 2, 3), 0, torch.bfloat16, 2, 32),
    Case("32M model, vLLM CPU layout, bf16", 8, (-1, 4, 128, 128), (0, 1, 2, 3), 0, torch.bfloat16, 2, 32),
    Case("8B-like rank, flash-attn NHD, bf16", 32, (2, -1, 16, 8, 128), (0, 1, 2, 3, 4), 1, torch.bfloat16, 16, 2),
    Case("8B-like rank, FlashInfer HND, fp8", 32, (-1, 2, 8, 16, 128), (0, 1, 2, 3, 4), 0, torch.uint8, 16, 2),
    Case("HND by strides (16 B runs), fp8", 8, (2, -1, 8, 16, 16), (0, 1, 3, 2, 4), 1, torch.uint8, 16, 8),
]


def build(case: Case, device: torch.device, gen: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                           list[torch.Tensor]]:
    needed = case.blocks_per_chunk * case.num_chunks
    num_blocks = 2 * needed
    physical = tuple(num_blocks if s == -1 else s for s in case.physical)
    whole = torch.randint(0, 100, (case.num_layers, *physical), dtype=torch.uint8, device=device)
    whole = whole.view(case.dtype) if case.dtype.itemsize == 1 else whole.to(case.dtype)
    layers = [whole[i].permute(case.perm).movedim(case.block_dim, 0) for i in range(case.num_layers)]
    ids = torch.randperm(num_blocks, generator=gen)[:needed]
    table = torch.tensor([(i // case.blocks_per_chunk, i % case.blocks_per_chunk, int(b)) for i, b in enumerate(ids)],
                         dtype=torch.long)
    shape = (case.num_layers, case.blocks_per_chunk, *layers[0].shape[1:])
    chunks = [torch.zeros(shape, dtype=case.dtype, device=device) for _ in range(case.num_chunks)]
    return layers, table, chunks


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return run


def interleaved_best(repeats: int, fns: list[Callable[[], object]], device: torch.device) -> list[float]:
    clock = timer(device)
    for fn in fns:  # warm-up: page faults, thread pool, kernel loading
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], clock(fn))
    return best


def bench_case(case: Case, device: torch.device, repeats: int, per_chunk: bool = False) -> dict[str, float]:
    layers, table, chunks = build(case, device, torch.Generator().manual_seed(0))
    nbytes = sum(c.numel() * c.element_size() for c in chunks)
    plain_src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    plain_dst = torch.zeros_like(plain_src)
    fns: list[Callable[[], object]] = [
        lambda: plain_dst.copy_(plain_src),
        lambda: kernels.gather(layers, table, chunks, via="native"),
        lambda: kernels.gather(layers, table, chunks, via="torch"),
        lambda: kernels.scatter(layers, table, chunks, via="native"),
        lambda: kernels.scatter(layers, table, chunks, via="torch"),
    ]
    if per_chunk:
        # As the connector calls them today: one call (all layers) per chunk, its table built per call.
        rows = table.tolist()
        per = [rows[i * case.blocks_per_chunk:(i + 1) * case.blocks_per_chunk] for i in range(case.num_chunks)]

        def each(op: Callable[..., None], via: str) -> Callable[[], object]:
            def run() -> None:
                for i, chunk_rows in enumerate(per):
                    t = torch.tensor([(0, slot, block) for _, slot, block in chunk_rows], dtype=torch.long)
                    op(layers, t, [chunks[i]], via=via)
            return run

        fns[1:] = [each(kernels.gather, "native"), each(kernels.gather, "torch"),
                   each(kernels.scatter, "native"), each(kernels.scatter, "torch")]
    plain, g_nat, g_torch, s_nat, s_torch = interleaved_best(repeats, fns, device)
    return {"bytes": nbytes, "plain": plain, "g_nat": g_nat, "g_torch": g_torch, "s_nat": s_nat, "s_torch": s_torch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--repeats", type=int, default=0, help="timed repeats per measurement (default 15 cpu, 100 cuda)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for every path (default: torch's; 1 is steadier on a busy host)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = args.repeats or (100 if device.type == "cuda" else 15)
    kernels.load_extension()
    print(f"device {device}, torch threads {torch.get_num_threads()}, best of {repeats} interleaved repeats")
    print(f"{'case':36} {'MiB':>6} {'plain GB/s':>10} | {'gather GB/s':>11} {'/plain':>6} {'/torch':>6} | "
          f"{'scatter GB/s':>12} {'/plain':>6} {'/torch':>6}")
    rows = [(case, False) for case in CASES] + [(case, True) for case in CASES[:2]]
    for case, per_chunk in rows:
        if device.type == "cuda":  # a GPU moves far more per step; keep each row well above launch overhead
            case = dataclasses.replace(case, num_chunks=case.num_chunks * 8)
        r = bench_case(case, device, repeats, per_chunk)
        gbs = r["bytes"] / 1e9
        name = f"{case.name.split(',')[0]}, one call per chunk" if per_chunk else case.name
        print(f"{name:36} {r['bytes'] / 2**20:6.1f} {gbs / r['plain']:10.2f} | "
              f"{gbs / r['g_nat']:11.2f} {r['plain'] / r['g_nat']:6.2f} {r['g_torch'] / r['g_nat']:5.1f}x | "
              f"{gbs / r['s_nat']:12.2f} {r['plain'] / r['s_nat']:6.2f} {r['s_torch'] / r['s_nat']:5.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
