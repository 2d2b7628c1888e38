"""Blend attention through vLLM's own CPU attention kernel, over the request's paged blocks (vLLM worker process).

The blender's reference attention (``attention.attend``, torch SDPA with an
explicit causal mask) is several times slower than vLLM's CPU kernel on long
prompts, and the layers before the first check layer attend every blended
token to everything before it: with SDPA the blend would cost about as much as
the prefill it replaces. Here each layer's K/V of the blended tokens is first
written into the request's paged blocks (``cpu_attn_reshape_and_cache``, the
op vLLM itself uses), then the queries attend with ``cpu_attention_with_kv_cache``:
each run of consecutive query positions is one "request" of the kernel whose
sequence ends at the run's last position, all sharing the prompt's block table,
so scattered recomputed tokens cost what decoding them would.

Each isolated query streams its keys' K/V from memory for one query row, so
15% scattered queries cost 36-45% of a dense layer's attention (8k-token
prompts; the more the machine is loaded, the more). Two GEMM-shaped
alternatives were measured on the project's 2-core CPU and are not used:
torch's flash attention over groups of queries (a masked tail per group,
merged by log-sum-exp) ran at half the kernel's dense speed and paid a thread
handoff per op on a busy machine; and this kernel itself over groups (one
non-causal request per group for the whole blocks before it, one-token
requests for the rest, the two merged through extra "mass" columns in a padded
K/V copy) was 13% faster on a quiet machine and no faster on a busy one, once
the padding and the copy were paid.

After a check layer the blender passes one positions tensor to every later
layer: the runs, block table rows and scheduler metadata are planned once.

Scattered queries go to lmi-cache's own kernel instead when it is built
(``transfer.kernels.scattered_attention``, native backend, float32 KV): it
takes the sorted queries in groups of 64 query rows per KV head, so one pass
over a tile of keys serves the whole group from L1, GEMM-shaped, where vLLM's
kernel re-reads every key for each one-token query. For the benchmark's 1,211
scattered queries over 8,111 tokens it took 36-55 ms a layer against 65-85 ms
for vLLM's kernel in side-by-side runs on an AVX-512 host, and 2.2-2.6x less
than vLLM's kernel with the AVX2 variant on an AVX2-only host
(``benchmarks/bench_blend_attention.py``). It reads the K/V from
the contiguous tensors the blend already holds (the request's prefix, read
once, and the blended tokens), not from the paged blocks. A single run of
consecutive positions (every token recomputed, or a segment computed alone)
stays on vLLM's kernel: it is what vLLM's own prefill runs, so a blend at
ratio 1.0 gives vLLM's numbers.

The same kernel gives layer 0's attention of a segment's tokens to what precedes
the segment, with each row's log-sum-exp (``cross_attention``), which the
blender merges with the segment's stored attention over itself
(``layer0_reuse``); vLLM's kernel returns no log-sum-exp, so without the native
kernel layer 0 is attended in full.

CPU only (layout kind ``cpu``); other devices use the reference attention.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from lmi_cache.transfer import kernels


def _runs(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query start offsets [R+1] and sequence lengths [R] of the runs of consecutive ``positions`` (ascending)."""
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    starts = torch.cat((torch.zeros(1, dtype=torch.long), breaks))
    ends = torch.cat((breaks, torch.tensor([positions.numel()])))
    seq_lens = positions[ends - 1] + 1
    query_start_loc = torch.cat((starts, ends[-1:]))
    return query_start_loc.to(torch.int32), seq_lens.to(torch.int32)


class CpuPagedAttention:
    """Per-layer write + attend over one rank's CPU paged KV cache."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], attn_layers: Sequence[Any], block_size: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self._ops = ops
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for cache in kv_caches:
            nb, h, n, _ = cache.shape
            key_cache, value_cache = cache.view(nb, h, 2 * n, -1).chunk(2, dim=2)
            self._caches.append((key_cache, value_cache))
        self.block_size = block_size
        self.num_heads, self._num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self._scale = scale
        self._dtype = kv_caches[0].dtype
        first = attn_layers[0]
        impl = getattr(first, "impl", None)
        self._kv_cache_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
        self._isa = getattr(first, "isa", None) or _get_attn_isa(self._dtype, block_size, head_dim, self._kv_cache_dtype)
        self._block_table: torch.Tensor | None = None
        self._block_ids: tuple[int, ...] = ()
        self.written: set[int] = set()  # layers whose K/V the bound request's blocks already hold (``layer_attention``)
        self.write_seconds = 0.0  # time ``layer_attention`` spent writing K/V into the blocks (for the metrics)
        self._plan: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None  # (positions, kernel arguments)
        # lmi-cache's scattered-query kernel: float32 KV stored as is, and the native backend in use.
        # The prefix K/V it reads come through PagedKV, which sees the plain [token, dim] block
        # layout of vLLM's "vec" ISAs (float32 is never "amx").
        # The kernel's shape limits are asked once here (from the kernel itself) rather than
        # failing every blend.
        self.native_scattered = (self._dtype == torch.float32 and self._kv_cache_dtype == "auto"
                                 and self._isa in ("vec", "vec16") and kernels.native_blend_ops()
                                 and kernels.scattered_attention_supports(num_heads, num_kv_heads, head_dim))
        self.native_calls = 0  # layers whose queries the native kernel attended (tests, metrics)
        self.cross_tokens = 0  # tokens whose layer-0 attention was merged with their segment's stored one (metrics)

    def scratch(self, num_tokens: int) -> "CpuPagedAttention":
        """The same kernel over private blocks for ``num_tokens`` tokens (a segment computed alone), bound."""
        num_blocks = -(-num_tokens // self.block_size)
        shape = (num_blocks, self._num_kv_heads, self.block_size, 2 * self.head_dim)
        other = CpuPagedAttention.__new__(CpuPagedAttention)
        other.__dict__.update(self.__dict__)
        other._caches = []
        for _ in self._caches:  # the views keep their storage alive
            # Zeroed: the kernel reads whole blocks, and masked-out garbage (NaN) times 0 is still NaN.
            key_cache, value_cache = torch.zeros(shape, dtype=self._dtype).view(
                num_blocks, self._num_kv_heads, 2 * self.block_size, -1).chunk(2, dim=2)
            other._caches.append((key_cache, value_cache))
        other.bind(range(num_blocks))
        return other

    def bind(self, block_ids: Sequence[int]) -> None:
        """The request whose blocks the following calls read and write."""
        self._block_ids = tuple(block_ids)
        self._block_table = torch.tensor(self._block_ids, dtype=torch.int32)
        self.written = set()
        self._plan = None

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V [T, H_kv, D] as the request's tokens [start, start + T) of ``layer``."""
        positions = torch.arange(start, start + k.shape[0])
        blocks = torch.tensor(self._block_ids, dtype=torch.long)[positions // self.block_size]
        slots = blocks * self.block_size + positions % self.block_size
        key_cache, value_cache = self._caches[layer]
        self._ops.cpu_attn_reshape_and_cache(
            k.to(self._dtype).contiguous(), v.to(self._dtype).contiguous(), key_cache, value_cache, slots, self._isa,
            kv_cache_dtype=self._kv_cache_dtype,
        )

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention [Tq, H*D] of queries q [Tq, H, D] at ascending ``positions`` over the paged tokens before them."""
        assert self._block_table is not None, "bind() the request first"
        if self._plan is None or self._plan[0] is not positions:
            query_start_loc, seq_lens = _runs(positions)
            num_runs = int(seq_lens.numel())
            block_table = self._block_table.expand(num_runs, -1).contiguous()
            metadata = self._ops.cpu_attn_get_scheduler_metadata(
                num_reqs=num_runs, num_heads=self.num_heads, num_kv_heads=self._num_kv_heads,
                head_dim=self.head_dim, seq_lens=seq_lens, dtype=self._dtype, query_start_loc=query_start_loc,
                causal=True, sliding_window_size=-1, isa=self._isa, enable_kv_split=False,
                kv_cache_dtype=self._kv_cache_dtype,
            )
            self._plan = (positions, (query_start_loc, seq_lens, block_table, metadata))
        query_start_loc, seq_lens, block_table, metadata = self._plan[1]
        out = torch.empty((q.shape[0], self.num_heads, self.head_dim), dtype=self._dtype)
        key_cache, value_cache = self._caches[layer]
        self._ops.cpu_attention_with_kv_cache(
            query=q.to(self._dtype).contiguous(), key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=self._scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None,
            kv_cache_dtype=self._kv_cache_dtype,
        )
        return out.reshape(q.shape[0], -1)

    def attend_scattered(self, q: torch.Tensor, positions: torch.Tensor, keys: Sequence[torch.Tensor],
                         values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Attention [Tq, H*D] by the native kernel over contiguous K/V laid end to end from position 0."""
        self.native_calls += 1
        return self._native(q, positions, keys, values)

    def attend_with_lse(self, q: torch.Tensor, limits: torch.Tensor, keys: Sequence[torch.Tensor],
                        values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Native attention [Tq, H*D] of q to the keys at positions <= ``limits`` (contiguous K/V from 0), and its lse [Tq, H]."""
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        return self._native(q, limits, keys, values, lse), lse

    def _native(self, q: torch.Tensor, positions: torch.Tensor, keys: Sequence[torch.Tensor],
                values: Sequence[torch.Tensor], lse: torch.Tensor | None = None) -> torch.Tensor:
        out = kernels.scattered_attention(q.to(torch.float32).contiguous(), positions.to(torch.long).contiguous(),
                                          keys, values, self._scale, lse=lse)
        return out.reshape(q.shape[0], -1)

    def cross_attention(self, prefix: Any) -> Any:
        """The blender's ``CrossAttention`` for a request whose first ``prefix.num_tokens`` tokens are ``prefix`` (native only)."""
        if not self.native_scattered:
            raise RuntimeError("cross attention needs the native kernel")

        def cross(layer: int, q: torch.Tensor, limits: torch.Tensor, k_blended: torch.Tensor,
                  v_blended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.cross_tokens += int(q.shape[0])
            return self.attend_with_lse(q, limits, (prefix.k[layer], k_blended), (prefix.v[layer], v_blended))

        return cross

    def layer_attention(self, start: int, prefix: Any = None) -> Any:
        """The blender's attention hook for a request bound with ``bind`` whose blended tokens start at ``start``.

        ``prefix`` (a ``KVStack`` of the request's first ``start`` tokens, every layer) lets
        scattered queries use the native kernel; without it they use vLLM's.
        """
        native = self.native_scattered and prefix is not None and prefix.num_tokens == start

        def attention(layer: int, q: torch.Tensor, positions: torch.Tensor, k_blended: torch.Tensor,
                      v_blended: torch.Tensor) -> torch.Tensor:
            started = time.perf_counter()
            self.write(layer, start, k_blended, v_blended)
            self.write_seconds += time.perf_counter() - started
            # The layer's K/V are final once its queries attend (the blender changes a layer's
            # rows only before its attention), so the caller need not write this layer again.
            self.written.add(layer)
            if native and k_blended.dtype == torch.float32 and not _one_run(positions):
                return self.attend_scattered(q, positions, (prefix.k[layer], k_blended), (prefix.v[layer], v_blended))
            return self.attend(layer, q, positions)

        return attention


def _one_run(positions: torch.Tensor) -> bool:
    """Whether ascending ``positions`` are consecutive (one run)."""
    n = positions.numel()
    return n == 0 or int(positions[-1]) - int(positions[0]) == n - 1
