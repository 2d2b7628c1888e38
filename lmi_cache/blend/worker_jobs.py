"""Worker half of blending: run blends into vLLM's paged cache and store segments' own KV (vLLM worker process).

* ``run_blends`` (from ``start_load_kv``, before the forward pass): for each
  ``BlendJob``, read the exact prefix KV from the paged blocks, load each cached
  segment's KV from the engine (one tensor ``[layers, 2, T, kv_heads, head_dim]``
  per segment, K after RoPE at positions 0..T-1), run ``blender.blend`` with the
  model's own layers, and write every layer's K/V of the blended tokens into the
  request's blocks. A segment the engine no longer has (or a damaged one) is
  computed in full instead (a counted fault, same output as a cold prefill of
  that segment in context). Any other failure reports the job's blocks as load
  errors: vLLM recomputes them, so a fault never fails a request. With the
  native CPU kernel each segment's layer-0 attention over itself is loaded too
  (``layer0_reuse``); without it, layer 0 is attended in full.
* ``run_stores`` (from ``wait_for_save``): each ``SegmentStore`` is one small
  forward of the segment alone at positions 0..T-1 (``blender.segment_kv``)
  stored with ``engine.save_many``; the engine reports the digest so the
  scheduler learns the segment is cached. With the native kernel the segment's
  layer-0 attention over itself is stored beside it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from lmi_cache.blend import layer0_reuse
from lmi_cache.blend.attention import SegmentAttention
from lmi_cache.blend.blender import CrossAttention, KVStack, LayerAttention, LayerwiseModel, blend, prefill, segment_kv
from lmi_cache.blend.engine_io import load_segments, save_segment
from lmi_cache.blend.jobs import BlendJob, SegmentStore
from lmi_cache.blend.paged_kv import PagedKV
from lmi_cache.blend.settings import BlendSettings
from lmi_cache.metrics.counts import Count, RankCounts

if TYPE_CHECKING:
    from lmi_cache.keys.hashing import ChunkKey
    from lmi_cache.engine import Engine

logger = logging.getLogger(__name__)


class PagedAttention(Protocol):
    """A device's attention kernel over one request's paged KV (``lmi_cache.vllm_connector.cpu_paged_attention``)."""

    native_scattered: bool  # scattered queries and layer-0 log-sum-exps come from lmi-cache's native kernel
    num_heads: int
    head_dim: int
    written: set[int]  # layers the bound request's blocks already hold (``layer_attention`` wrote them)
    write_seconds: float
    native_calls: int
    cross_tokens: int

    def bind(self, block_ids: Sequence[int]) -> None: ...
    def scratch(self, num_tokens: int) -> PagedAttention: ...
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def layer_attention(self, start: int, prefix: KVStack | None = None) -> LayerAttention: ...
    def cross_attention(self, prefix: KVStack) -> CrossAttention: ...
    def attend_with_lse(self, q: torch.Tensor, limits: torch.Tensor, keys: Sequence[torch.Tensor],
                        values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]: ...


class BlendWorkerStats(RankCounts):
    """This rank's blend counts, each the rank's ``lmi_cache_blend_*`` series (``lmi_cache.metrics.counts``)."""

    what = "blend metrics"
    num_blends = Count("lmi_cache_blend_jobs", "Blends written into vLLM's KV cache")
    num_blend_faults = Count("lmi_cache_blend_job_faults", "Blends given back to vLLM to recompute")
    num_segments_loaded = Count("lmi_cache_blend_segments_loaded", "Cached segments read back for blends")
    num_segment_misses = Count("lmi_cache_blend_segment_misses",  # computed in full
                               "Segments planned as cached but missing or damaged")
    num_blended_tokens = Count("lmi_cache_blend_blended_tokens", "Tokens whose KV came from cached segments")
    num_recomputed_tokens = Count("lmi_cache_blend_recomputed_tokens", "Blended tokens recomputed past the check layers")
    num_segments_stored = Count("lmi_cache_blend_segments_stored", "Segments computed alone and stored")
    num_segment_store_faults = Count("lmi_cache_blend_segment_store_faults", "Segment stores that failed")
    num_native_attention_layers = Count(
        "lmi_cache_blend_native_attention_layers",
        "Layers whose recomputed tokens lmi-cache's native CPU kernel attended (the rest: vLLM's kernel)")
    num_layer0_reused_tokens = Count(
        "lmi_cache_blend_layer0_reused_tokens",
        "Blended tokens whose layer-0 attention within their segment came from the segment's stored attention")
    num_layer0_attention_stored = Count("lmi_cache_blend_layer0_attention_stored",
                                        "Segments whose layer-0 attention over themselves was stored beside their KV")
    blend_seconds = Count("lmi_cache_blend_seconds", "Seconds spent blending (loads and KV writes included)")
    blend_load_seconds = Count("lmi_cache_blend_load_seconds",  # of blend_seconds
                               "Seconds of blending spent reading prefix and segments")
    blend_write_seconds = Count("lmi_cache_blend_write_seconds",  # of blend_seconds, in the attention or after
                                "Seconds of blending spent writing KV into vLLM's cache")
    store_seconds = Count("lmi_cache_blend_segment_store_seconds", "Seconds spent computing and storing segments")


class BlendWorker:
    """One rank's blending; ``model`` and ``paged`` are attached once the KV caches are registered."""

    def __init__(self, settings: BlendSettings, model: LayerwiseModel, paged: PagedKV, rank_index: int,
                 paged_attention: PagedAttention | None = None) -> None:
        self.settings = settings
        self.model = model
        self.paged = paged
        self.paged_attention = paged_attention  # vLLM's CPU kernel; None: the reference attention
        self.rank_index = rank_index
        self.stats = BlendWorkerStats(rank_label=str(rank_index))  # in the engine's registry from the first job

    # -- blends --------------------------------------------------------------------------

    def run_blends(self, jobs: Sequence[BlendJob], engine: Engine) -> set[int]:
        """Blend each job into its blocks; the block ids of jobs that failed (vLLM recomputes them)."""
        self.stats.attach(engine.metrics)
        failed: set[int] = set()
        for job in jobs:
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._blend_one(job, engine)
                self.stats.add(BlendWorkerStats.num_blends)
            except Exception as err:  # noqa: BLE001 - a cache fault must never fail a request
                self.stats.add(BlendWorkerStats.num_blend_faults)
                block = self.paged.block_size
                failed.update(job.block_ids[job.prefix_tokens // block : -(-job.end // block)])
                logger.warning("lmi-cache: blend of request %s failed (%r); vLLM recomputes it", job.req_id, err)
            self.stats.add(BlendWorkerStats.blend_seconds, time.perf_counter() - started)
        return failed

    def _check_segment(self, data: torch.Tensor | None, num_tokens: int) -> KVStack | None:
        num_layers = self.paged.num_layers
        if data is None or data.dim() != 5 or tuple(data.shape[:3]) != (num_layers, 2, num_tokens):
            self.stats.add(BlendWorkerStats.num_segment_misses)
            return None
        self.stats.add(BlendWorkerStats.num_segments_loaded)
        return KVStack(data[:, 0], data[:, 1])

    def _reuses_layer0(self) -> bool:
        """Whether segments' layer-0 attention is stored and merged: only where the native kernel gives the lse.

        (The reference attention would cost more than vLLM's kernel saves.)
        """
        return self.paged_attention is not None and self.paged_attention.native_scattered

    def _check_attention(self, data: torch.Tensor | None, num_tokens: int) -> SegmentAttention | None:
        """A stored layer-0 attention of this segment's shape, or None (layer 0 is then computed in full)."""
        assert self.paged_attention is not None
        return layer0_reuse.unpack(data, num_tokens, self.paged_attention.num_heads, self.paged_attention.head_dim)

    def _blend_one(self, job: BlendJob, engine: Engine) -> None:
        started = time.perf_counter()
        prefix_k, prefix_v = self.paged.read(job.block_ids, 0, job.prefix_tokens)
        prefix = KVStack(prefix_k, prefix_v)
        tokens = torch.tensor(job.token_ids, dtype=torch.long)
        seg_tokens: list[torch.Tensor] = []
        cached: list[KVStack | None] = []
        wanted = [(i, piece.keys[self.rank_index]) for i, piece in enumerate(job.pieces) if piece.keys is not None]
        reuse = self._reuses_layer0()
        # Each segment from the tier the directory named; its layer-0 attention object too, where one is held.
        with_attention = [(i, key) for i, key in wanted if reuse and job.pieces[i].attention_source]
        keys = [key for _, key in wanted] + [layer0_reuse.attention_key(key) for _, key in with_attention]
        pieces = [job.pieces[i] for i, _ in wanted]
        sources = [p.source for p in pieces] + [job.pieces[i].attention_source for i, _ in with_attention]
        promote = [bool(p.promote_to) for p in pieces] + \
            [bool(job.pieces[i].attention_promote_to) for i, _ in with_attention]
        found = load_segments(engine, keys, sources, promote)
        loaded = dict(zip((i for i, _ in wanted), found))
        stored_attention = dict(zip((i for i, _ in with_attention), found[len(wanted):]))
        within: list[SegmentAttention | None] = []
        for i, piece in enumerate(job.pieces):
            seg_tokens.append(tokens[piece.start - job.prefix_tokens : piece.end - job.prefix_tokens])
            kv = self._check_segment(loaded[i], piece.end - piece.start) if i in loaded else None
            cached.append(None if kv is None else KVStack(kv.k.to(prefix.k.dtype), kv.v.to(prefix.v.dtype)))
            within.append(self._check_attention(stored_attention.get(i), piece.end - piece.start)
                          if reuse and kv is not None else None)
        num_cached = sum(int(t.numel()) for t, c in zip(seg_tokens, cached) if c is not None)
        self.stats.add(BlendWorkerStats.blend_load_seconds, time.perf_counter() - started)
        attention = None
        if num_cached == 0:
            new_kv, _ = prefill(self.model, tokens, prefix)  # every cached segment went missing: a plain prefill
            recomputed = tokens.numel()
        else:
            settings = self.settings
            if job.recompute_ratios is not None:
                settings = replace(settings, recompute_ratios=job.recompute_ratios)
            counts = settings.recompute_counts(num_cached)
            cross = None
            if self.paged_attention is not None:
                self.paged_attention.bind(job.block_ids)
                attention = self.paged_attention.layer_attention(job.prefix_tokens, prefix)
                cross = self.paged_attention.cross_attention(prefix) if reuse else None
                hook_writes = self.paged_attention.write_seconds
                native_calls = self.paged_attention.native_calls
                cross_tokens = self.paged_attention.cross_tokens
            outcome = blend(self.model, prefix, seg_tokens, cached, settings.check_layers, counts, attention=attention,
                            include_prefix=False, layer0_within=within if reuse else None, cross_attention=cross)
            new_kv = outcome.kv
            recomputed = int(outcome.recomputed.numel())
            paged = self.paged_attention
            if paged is not None:
                self.stats.add(BlendWorkerStats.blend_write_seconds, paged.write_seconds - hook_writes)
                self.stats.add(BlendWorkerStats.num_native_attention_layers, paged.native_calls - native_calls)
                self.stats.add(BlendWorkerStats.num_layer0_reused_tokens, paged.cross_tokens - cross_tokens)
        if not _finite(new_kv):
            raise ValueError("blended KV is not finite")  # a fault: vLLM recomputes the blocks
        started = time.perf_counter()
        if self.paged_attention is not None:
            # Layers the blend's attention already wrote into these blocks are final there.
            done = self.paged_attention.written if attention is not None else set()
            self.paged_attention.bind(job.block_ids)
            for layer in range(new_kv.k.shape[0]):
                if layer not in done:
                    self.paged_attention.write(layer, job.prefix_tokens, new_kv.k[layer], new_kv.v[layer])
        else:
            self.paged.write(job.block_ids, job.prefix_tokens, new_kv.k, new_kv.v)
        self.stats.add(BlendWorkerStats.blend_write_seconds, time.perf_counter() - started)
        self.stats.add(BlendWorkerStats.num_blended_tokens, num_cached)
        self.stats.add(BlendWorkerStats.num_recomputed_tokens, recomputed)

    # -- segment stores ------------------------------------------------------------------

    def run_stores(self, stores: Sequence[SegmentStore], engine: Engine) -> None:
        self.stats.attach(engine.metrics)
        for store in stores:
            started = time.perf_counter()
            key = store.keys[self.rank_index]
            try:
                attention = None
                if self.paged_attention is not None:
                    attention = self.paged_attention.scratch(len(store.token_ids)).layer_attention(0)
                tokens = torch.tensor(store.token_ids, dtype=torch.long)
                layer0: SegmentAttention | None = None
                with torch.inference_mode():
                    if self._reuses_layer0():
                        paged = self.paged_attention
                        assert paged is not None
                        kv, layer0 = layer0_reuse.segment_kv_and_attention(
                            self.model, tokens, attention,
                            lambda q, limits, k, v, scale: paged.attend_with_lse(q, limits, [k], [v]))
                    else:
                        kv = segment_kv(self.model, tokens, attention)
                if not _finite(kv):
                    raise ValueError("segment KV is not finite")
                dtype = self.paged.layout.dtype
                shape = (kv.k.shape[0], 2, *kv.k.shape[1:])

                def fill(out: torch.Tensor, kv: KVStack = kv) -> None:
                    out[:, 0].copy_(kv.k.to(out.dtype))
                    out[:, 1].copy_(kv.v.to(out.dtype))

                if save_segment(engine, key, tuple(int(s) for s in shape), dtype, fill, store.tiers):
                    self.stats.add(BlendWorkerStats.num_segments_stored)
                    if layer0 is not None and store.attention_tiers:
                        self._store_layer0_attention(engine, key, layer0, store.attention_tiers)
            except Exception as err:  # noqa: BLE001 - a missed store is only a later miss
                self.stats.add(BlendWorkerStats.num_segment_store_faults)
                logger.warning("lmi-cache: segment KV of request %s not stored (%r)", store.req_id, err)
            self.stats.add(BlendWorkerStats.store_seconds, time.perf_counter() - started)

    def _store_layer0_attention(self, engine: Engine, key: ChunkKey, att: SegmentAttention,
                                tiers: Sequence[str]) -> None:
        """Store the segment's layer-0 attention over itself (``layer0_reuse``) beside its KV.

        A failure here is logged, not a store fault: the segment's KV is stored, and a blend
        without its attention object attends layer 0 in full.
        """
        try:
            self._save_layer0_attention(engine, key, att, tiers)
        except Exception as err:  # noqa: BLE001 - a missing attention object only costs layer 0 in full
            logger.warning("lmi-cache: layer-0 attention of a segment not stored (%r)", err)

    def _save_layer0_attention(self, engine: Engine, key: ChunkKey, att: SegmentAttention,
                               tiers: Sequence[str]) -> None:
        if not (bool(torch.isfinite(att.out.sum())) and bool(torch.isfinite(att.lse.sum()))):
            raise ValueError("layer-0 attention is not finite")
        shape = layer0_reuse.packed_shape(*att.out.shape)
        if save_segment(engine, layer0_reuse.attention_key(key), shape, torch.float32,
                        lambda out: layer0_reuse.pack(att, out), tiers):
            self.stats.add(BlendWorkerStats.num_layer0_attention_stored)


def _finite(kv: KVStack) -> bool:
    """No NaN or inf anywhere (one float32 sum per tensor: a single pass, no mask tensor)."""
    return bool(torch.isfinite(kv.k.sum(dtype=torch.float32))) and bool(torch.isfinite(kv.v.sum(dtype=torch.float32)))
