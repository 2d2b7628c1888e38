"""Prometheus series of a worker rank's engine (vLLM worker processes), where bytes move.

``CacheMetrics`` is written by each worker's engine. Labels: ``engine`` (the
data-parallel replica) and ``rank`` (the TP/PP rank inside the replica); tier
series also ``tier`` (cpu, disk; ``engine``/``connector`` for faults outside
a tier). The scheduler's series are in ``metrics.scheduler_series``.

With ``PROMETHEUS_MULTIPROC_DIR`` set (``lmi-cache serve`` does it) the values
live in per-process files that vLLM's ``/metrics`` aggregates; gauges use
``mostrecent`` so a restarted process's last value wins. Each object owns a
CollectorRegistry (several engines in one test process never collide) that
the opt-in exporters of ``metrics.server`` serve.

Worker series (per rank; with TP every rank holds its own part of each token's KV):

- lmi_cache_loaded_tokens_total{tier}             tokens of chunks read back from the tier
- lmi_cache_stored_chunks_total{tier}             chunks stored
- lmi_cache_stored_tokens_total{tier}             tokens stored
- lmi_cache_stored_bytes_total{tier}              chunk-object bytes stored
- lmi_cache_evictions_total{tier}                 chunks evicted, as the placement directory decided
- lmi_cache_tier_safety_net_total{tier,reason}    planned puts a tier refused because its medium ran out
                                                  (full, no_space): should stay 0
- lmi_cache_dropped_stores_total{tier,reason}     stores refused (queue_full, too_large, tier_off, error)
- lmi_cache_fingerprint_mismatches_total{tier}    loads whose token fingerprint differed (a miss)
- lmi_cache_corrupted_reads_total{tier}           loads of damaged objects (a miss; file removed)
- lmi_cache_tier_errors_total{tier,op}            faults turned into misses (ENOSPC, EIO, a missing chunk, ...)
- lmi_cache_untrusted_files_total{tier,reason}    entries ignored as not ours (symlink, not_regular,
                                                  foreign_owner) and directories refused (unsafe_dir, busy_dir)
- lmi_cache_tier_usage_bytes{tier}                bytes held now
- lmi_cache_tier_capacity_bytes{tier}             byte budget
- lmi_cache_load_seconds{tier}                    latency of a successful load (histogram)
- lmi_cache_store_seconds{tier}                   latency of a store (CPU: copy; disk: file write)

The connector's own counts of each rank (``WorkerStats`` in ``vllm_connector.worker_stats``,
same registry and labels, see ``metrics.counts``):

- lmi_cache_worker_loaded_chunks_total            chunks copied into vLLM's KV cache
- lmi_cache_worker_loaded_bytes_total             KV bytes those copies wrote
- lmi_cache_worker_load_faults_total              planned chunks that did not land (vLLM recomputes them)
- lmi_cache_worker_saved_chunks_total             chunks gathered after forward passes and stored
- lmi_cache_worker_refused_saves_total            chunks the engine refused to store (no room)
- lmi_cache_worker_save_faults_total              chunks whose gather or store failed (a future miss)
- lmi_cache_worker_load_seconds_total             model-thread seconds reading hits and copying them in
- lmi_cache_worker_save_seconds_total             model-thread seconds gathering and storing chunks

Blending series of each worker rank (``LmiCacheConnector`` with
``enable_blending`` on), in the registry of the rank's object above, so with
the same labels and the same exporter: ``BlendWorkerStats`` (``blend.worker_jobs``; each worker rank, {engine,rank}; its
counts are these counters, see ``metrics.counts``):

- lmi_cache_blend_jobs_total                      blends written into vLLM's KV cache
- lmi_cache_blend_job_faults_total                blends given back to vLLM to recompute
- lmi_cache_blend_segments_loaded_total           cached segments read back for blends
- lmi_cache_blend_segment_misses_total            segments planned as cached but missing or damaged
- lmi_cache_blend_blended_tokens_total            tokens whose KV came from cached segments
- lmi_cache_blend_recomputed_tokens_total         of those, tokens recomputed past the check layers
- lmi_cache_blend_segments_stored_total           segments computed alone and stored
- lmi_cache_blend_segment_store_faults_total      segment stores that failed (a future miss)
- lmi_cache_blend_seconds_total                   time spent blending (loads and KV writes included)
- lmi_cache_blend_load_seconds_total              of that, reading the prefix and the segments
- lmi_cache_blend_write_seconds_total             of that, writing every layer's KV into the paged cache
- lmi_cache_blend_segment_store_seconds_total     time spent computing and storing segments
"""
from __future__ import annotations

import threading
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Several processes write one gauge name; each (engine, rank, tier) is written by one process.
_GAUGE_MODE: Final = "mostrecent"


# Sample of a worker series -> its name in ``CacheMetrics.snapshot()`` (the engine's ``stats()``).
_SNAPSHOT_KEYS: Final = {
    "lmi_cache_stored_chunks_total": "{tier}_stored_chunks",
    "lmi_cache_stored_bytes_total": "{tier}_stored_bytes",
    "lmi_cache_load_seconds_count": "{tier}_loads",
    "lmi_cache_loaded_tokens_total": "{tier}_loaded_tokens",
    "lmi_cache_evictions_total": "{tier}_evictions",
    "lmi_cache_dropped_stores_total": "{tier}_dropped_{reason}",
    "lmi_cache_fingerprint_mismatches_total": "{tier}_fingerprint_mismatches",
    "lmi_cache_corrupted_reads_total": "{tier}_corrupted_reads",
    "lmi_cache_tier_errors_total": "{tier}_errors_{op}",
    "lmi_cache_tier_safety_net_total": "{tier}_safety_net_{reason}",
    "lmi_cache_untrusted_files_total": "{tier}_untrusted_{reason}",
    "lmi_cache_tier_usage_bytes": "{tier}_usage_bytes",
    "lmi_cache_tier_capacity_bytes": "{tier}_capacity_bytes",
}


# Every tier safety net that fired in this process, whatever the registry (what tests read).
_SAFETY_NET_FIRINGS = 0
_SAFETY_NET_LOCK = threading.Lock()


def safety_net_firings() -> int:
    """How many planned puts the tiers of this process refused for lack of room (should stay 0)."""
    return _SAFETY_NET_FIRINGS


class CacheMetrics:
    """Counters and gauges of one engine (one worker rank); ``snapshot()`` reads them back for ``stats()``."""

    def __init__(self, rank_label: str = "0", registry: CollectorRegistry | None = None,
                 engine_label: str = "0") -> None:
        self.rank_label = rank_label
        self.engine_label = engine_label
        self._ids = (engine_label, rank_label)
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        tier = ["engine", "rank", "tier"]
        self._loaded = Counter("lmi_cache_loaded_tokens", "Tokens of chunks read back, by tier", tier, registry=r)
        self._chunks = Counter("lmi_cache_stored_chunks", "Chunks stored", tier, registry=r)
        self._tokens = Counter("lmi_cache_stored_tokens", "Tokens stored", tier, registry=r)
        self._bytes = Counter("lmi_cache_stored_bytes", "Chunk-object bytes stored", tier, registry=r)
        self._evictions = Counter("lmi_cache_evictions", "Chunks evicted for space", tier, registry=r)
        self._dropped = Counter("lmi_cache_dropped_stores", "Stores refused", [*tier, "reason"], registry=r)
        self._fp = Counter("lmi_cache_fingerprint_mismatches", "Loads with a foreign fingerprint", tier, registry=r)
        self._corrupt = Counter("lmi_cache_corrupted_reads", "Loads of damaged objects", tier, registry=r)
        self._errors = Counter("lmi_cache_tier_errors", "Faults turned into misses", [*tier, "op"], registry=r)
        # A tier refused what the placement directory planned because its medium ran out (memory, disk space):
        # the directory's sizes and the tier's disagree, a bug (tests assert it stays 0).
        self._safety_net = Counter("lmi_cache_tier_safety_net", "Planned puts a tier refused for lack of room",
                                   [*tier, "reason"], registry=r)
        self._untrusted = Counter("lmi_cache_untrusted_files", "Disk entries ignored as not ours", [*tier, "reason"],
                                  registry=r)
        self._usage = Gauge("lmi_cache_tier_usage_bytes", "Bytes held", tier, registry=r,
                            multiprocess_mode=_GAUGE_MODE)
        self._capacity = Gauge("lmi_cache_tier_capacity_bytes", "Byte budget", tier, registry=r,
                               multiprocess_mode=_GAUGE_MODE)
        self._load_s = Histogram("lmi_cache_load_seconds", "Load latency", tier, buckets=_LATENCY_BUCKETS_S, registry=r)
        self._store_s = Histogram(
            "lmi_cache_store_seconds", "Store latency", tier, buckets=_LATENCY_BUCKETS_S, registry=r
        )

    def stored(self, tier: str, num_tokens: int, num_bytes: int, seconds: float) -> None:
        self._chunks.labels(*self._ids, tier).inc()
        self._tokens.labels(*self._ids, tier).inc(num_tokens)
        self._bytes.labels(*self._ids, tier).inc(num_bytes)
        self._store_s.labels(*self._ids, tier).observe(seconds)

    def loaded(self, tier: str, seconds: float) -> None:
        self._load_s.labels(*self._ids, tier).observe(seconds)

    def loaded_tokens(self, tier: str, num_tokens: int) -> None:
        self._loaded.labels(*self._ids, tier).inc(num_tokens)

    def evicted(self, tier: str, num_chunks: int = 1) -> None:
        self._evictions.labels(*self._ids, tier).inc(num_chunks)

    def dropped(self, tier: str, reason: str) -> None:
        self._dropped.labels(*self._ids, tier, reason).inc()

    def fingerprint_mismatch(self, tier: str) -> None:
        self._fp.labels(*self._ids, tier).inc()

    def fingerprint_mismatches(self) -> float:
        """Loads this rank's tiers refused for a foreign token fingerprint so far, all tiers."""
        return sum(sample.value for family in self._fp.collect() for sample in family.samples
                   if sample.name.endswith("_total") and sample.labels.get("rank") == self.rank_label)

    def corrupted(self, tier: str) -> None:
        self._corrupt.labels(*self._ids, tier).inc()

    def error(self, tier: str, op: str) -> None:
        self._errors.labels(*self._ids, tier, op).inc()

    def safety_net(self, tier: str, reason: str) -> None:
        """A put the tier refused because its medium ran out (never an eviction of its own)."""
        global _SAFETY_NET_FIRINGS
        self._safety_net.labels(*self._ids, tier, reason).inc()
        with _SAFETY_NET_LOCK:
            _SAFETY_NET_FIRINGS += 1

    def untrusted(self, tier: str, reason: str) -> None:
        self._untrusted.labels(*self._ids, tier, reason).inc()

    def usage(self, tier: str, used_bytes: int, capacity_bytes: int) -> None:
        self._usage.labels(*self._ids, tier).set(used_bytes)
        self._capacity.labels(*self._ids, tier).set(capacity_bytes)

    def snapshot(self) -> dict[str, float]:
        """This rank's series as ``CacheEngine.stats()`` names them (``<tier>_<what>``), read from the registry."""
        ids = {"engine": self.engine_label, "rank": self.rank_label}
        out: dict[str, float] = {}
        for metric in self.registry.collect():
            for sample in metric.samples:
                key = _SNAPSHOT_KEYS.get(sample.name)
                labels = sample.labels
                if key is None or any(labels.get(k) != v for k, v in ids.items()):
                    continue
                out[key.format(**labels)] = sample.value
                if sample.name == "lmi_cache_dropped_stores_total":  # also all reasons together
                    total = f"{labels['tier']}_dropped_stores"
                    out[total] = out.get(total, 0.0) + sample.value
        return out
