"""Blending's CPU hot spots, native against what they replace, side by side in one process.

* Attention of the recomputed tokens (scattered through the prompt) after the check
  layer: lmi-cache's ``scattered_attention`` against vLLM's CPU kernel run as one
  one-token request per run of consecutive positions (what blending used before), and
  against vLLM's kernel over *every* token (a dense layer, for scale).
* Layer 0 over every blended token: vLLM's dense kernel against the native attention of
  each segment's tokens to what precedes the segment, merged with the segment's stored
  attention over itself (what a blend runs when segments carry it).
* Re-rotating every layer's cached K to the segment's new place: ``rotate_pairs`` (one
  pass) against the four torch passes it replaced.

Runs alternate (A, B, A, B, ...) so machine load hits both alike; medians and their
ratios are printed. Defaults are the RAG benchmark's shape: 8,111 tokens, 1,211
recomputed (ratio 0.15 of 8,079 blended tokens), the 32M model's 8 heads over 4 KV
heads of 64 dims, 8 layers.

    .venv/bin/python benchmarks/bench_blend_attention.py
    .venv/bin/python benchmarks/bench_blend_attention.py --heads 32 --kv-heads 8 --dim 128   # a Llama-3-8B layer
    .venv/bin/python benchmarks/bench_blend_attention.py --isa generic   # a narrower compiled variant
"""
from __future__ import annotations

import argparse

import torch
from interleaved import medians  # benchmarks/, beside this script

from lmi_cache.blend.attention import merge_attention
from lmi_cache.vllm_connector.cpu_paged_attention import CpuPagedAttention
from lmi_cache.blend.rope import _rotate
from lmi_cache.transfer import kernels

BLOCK = 32  # vLLM's CPU block size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8111)
    parser.add_argument("--prefix", type=int, default=32, help="tokens before the blended ones")
    parser.add_argument("--queries", type=int, default=1211, help="recomputed (scattered) tokens")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8, help="layers of cached K re-rotated")
    parser.add_argument("--segments", type=int, default=4, help="documents the blended tokens make (layer 0's reuse)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--isa", default="", help="the native kernel's compiled variant (avx512, avx2, generic); "
                        "default: the widest this CPU runs")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(args.seed)
    n, heads, kv_heads, dim = args.tokens, args.heads, args.kv_heads, args.dim
    scale = dim**-0.5
    k, v = torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen)
    num_blocks = -(-n // BLOCK)
    paged = CpuPagedAttention([torch.zeros(num_blocks, kv_heads, BLOCK, 2 * dim)], [object()], BLOCK, heads,
                              kv_heads, dim, scale)
    paged.bind(range(num_blocks))
    paged.write(0, 0, k, v)
    blended = torch.arange(args.prefix, n)
    positions = torch.sort(blended[torch.randperm(blended.numel(), generator=gen)[: args.queries]]).values
    q = torch.randn(positions.numel(), heads, dim, generator=gen)
    dense_q, dense_positions = torch.randn(n, heads, dim, generator=gen), torch.arange(n)
    keys, values = (k[: args.prefix], k[args.prefix :]), (v[: args.prefix], v[args.prefix :])

    isas = kernels.scattered_attention_isas()
    if args.isa and args.isa not in isas:
        parser.error(f"--isa {args.isa}: this CPU runs {', '.join(isas)}")
    isa = args.isa or isas[0]
    native = kernels.scattered_attention(q, positions, keys, values, scale, isa=isa).reshape(q.shape[0], -1)
    worst = float((native - paged.attend(0, q, positions)).abs().max())
    print(f"{n} tokens, {positions.numel()} scattered queries, {heads} heads / {kv_heads} KV heads x {dim}; "
          f"native ISA {isa}; max |native - vLLM| = {worst:.1e}; threads {torch.get_num_threads()}")
    med = medians(args.repeats, {
        "native": lambda: kernels.scattered_attention(q, positions, keys, values, scale, isa=isa),
        "vllm": lambda: paged.attend(0, q, positions),
        "vllm_dense": lambda: paged.attend(0, dense_q, dense_positions),
    }, warm_up=True)
    print("\n| attention of the recomputed tokens, one layer | median (ms) |\n|---|---|")
    print(f"| lmi-cache scattered_attention | {1000 * med['native']:.1f} |")
    print(f"| vLLM's CPU kernel, one request per run of positions | {1000 * med['vllm']:.1f} |")
    print(f"| vLLM's CPU kernel, every token (dense layer, for scale) | {1000 * med['vllm_dense']:.1f} |")
    print(f"\nvLLM / native = {med['vllm'] / med['native']:.2f}x; native is "
          f"{100 * med['native'] / med['vllm_dense']:.0f}% of a dense layer for "
          f"{100 * positions.numel() / n:.0f}% of its queries")

    # Layer 0 over every blended token: vLLM's dense kernel against what the blend runs when the
    # segments' own attention is stored (layer0_reuse): each segment's tokens attend only to what
    # precedes the segment (native, with the lse), merged with the stored part.
    segments = args.segments
    bounds = [args.prefix + (n - args.prefix) * i // segments for i in range(segments + 1)]
    limits = torch.cat([torch.full((b - a,), a - 1) for a, b in zip(bounds, bounds[1:])])
    q0 = torch.randn(n - args.prefix, heads, dim, generator=gen)
    within_out, within_lse = torch.randn(n - args.prefix, heads * dim, generator=gen), torch.randn(n - args.prefix, heads, generator=gen)
    dense0 = torch.arange(args.prefix, n)

    def merged() -> torch.Tensor:
        lse = torch.empty(q0.shape[0], heads)
        cross = kernels.scattered_attention(q0, limits, keys, values, scale, isa=isa, lse=lse).reshape(q0.shape[0], -1)
        return merge_attention(cross, lse, within_out, within_lse)

    l0 = medians(args.repeats, {"merged": merged, "vllm_dense": lambda: paged.attend(0, q0, dense0)}, warm_up=True)
    print(f"\n| layer 0 over the {n - args.prefix} blended tokens ({segments} segments) | median (ms) |\n|---|---|")
    print(f"| lmi-cache: attention to what precedes each segment + merge with the stored part | {1000 * l0['merged']:.1f} |")
    print(f"| vLLM's CPU kernel over every token | {1000 * l0['vllm_dense']:.1f} |")
    print(f"\nvLLM / lmi-cache = {l0['vllm_dense'] / l0['merged']:.2f}x")

    layers_k = torch.randn(args.layers, 2, n - args.prefix, kv_heads, dim, generator=gen)[:, 0]  # a stored segment's K
    angles = torch.rand(n - args.prefix, dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    out = torch.empty(args.layers, n - args.prefix, kv_heads, dim)
    rot = medians(args.repeats, {
        "native": lambda: kernels.rotate_pairs(layers_k, cos, sin, out),
        "torch": lambda: _rotate(layers_k, cos, sin, out),
    }, warm_up=True)
    print(f"\n| re-rotating {args.layers} layers of cached K ({n - args.prefix} tokens) | median (ms) |\n|---|---|")
    print(f"| lmi-cache rotate_pairs (one pass) | {1000 * rot['native']:.1f} |")
    print(f"| torch, four passes | {1000 * rot['torch']:.1f} |")
    print(f"\ntorch / native = {rot['torch'] / rot['native']:.2f}x")


if __name__ == "__main__":
    main()
