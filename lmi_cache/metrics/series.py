"""Prometheus series of lmi-cache, plus a rate-limited warner (vLLM scheduler and worker processes).

Two writers, in different processes of one vLLM server:

* ``SchedulerMetrics``: the scheduler (vLLM's engine-core process), where
  every prompt is looked up. Labels: ``engine`` (the data-parallel replica,
  as in vLLM's own series).
* ``CacheMetrics``: each worker's engine, where bytes move. Labels:
  ``engine`` and ``rank`` (the TP/PP rank inside the replica); tier series
  also ``tier`` (cpu, disk; ``engine``/``connector`` for faults outside a tier).

With ``PROMETHEUS_MULTIPROC_DIR`` set (``lmi-cache serve`` does it) the values
live in per-process files that vLLM's ``/metrics`` aggregates; gauges use
``mostrecent`` so a restarted process's last value wins. Each object owns a
CollectorRegistry (several engines in one test process never collide) that
the opt-in exporters of ``metrics.server`` serve.

Scheduler series (one lookup per request admission; re-asks while a request
waits for memory are not counted; a preempted request that is admitted again
is looked up again):

- lmi_cache_lookups_total{engine}                 requests looked up
- lmi_cache_session_releases_total{engine}        stateful sessions whose chunks stopped being retained
                                                  (closed, expired, or idle without the session store)
- lmi_cache_requested_tokens_total{engine}        prompt tokens of those requests
- lmi_cache_hit_tokens_total{engine}              of those, tokens held by the cache (whole chunks every
                                                  rank holds, at most prompt-1, block aligned), whether or
                                                  not vLLM's own prefix cache also had them
- lmi_cache_load_tokens_total{engine}             tokens the workers were told to load: the hit beyond
                                                  vLLM's own prefix cache (the prefill the cache saved)
- lmi_cache_scheduler_{match_queries,hit_requests,planned_saves,preemptions,remote_checks,remote_hit_chunks}_total{engine}
                                                  the scheduler's own counts (``SchedulerSide.stats`` reads them)
- lmi_cache_placement_evictions_total{engine,tier} entries the placement directory evicted (every rank's)
- lmi_cache_placement_dropped_total{engine,tier}  entries a worker's tier lost on its own (damaged or
                                                  unreadable, a failed write)
- lmi_cache_placement_unplanned_stores_total{engine,tier}
                                                  stores the directory never planned (refused, removed again;
                                                  a bug)
- lmi_cache_placement_evicted_before_confirm_total{engine,tier}
                                                  stores it planned and evicted before their worker confirmed
                                                  them (asynchronous scheduling; removed again)
- lmi_cache_placement_entries{engine,tier}        entries the directory holds now (every rank's)
- lmi_cache_session_retained_bytes{engine,tier}   bytes of open sessions' chunks evicted last (within
                                                  extra_config.session_retention_share of the tier)

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

Blending series (``LmiCacheConnector`` with ``enable_blending`` on), in the
registry of the scheduler's or the rank's object above, so with the same labels
and the same exporter. ``BlendSchedulerMetrics`` (scheduler, {engine}):

- lmi_cache_blend_planned_requests_total{engine}  requests admitted with a blend (vLLM accepted its tokens)
- lmi_cache_blend_planned_tokens_total{engine}    tokens those blends serve from cached segments
- lmi_cache_blend_segment_stores_total{engine}    segment stores issued to the workers (once per segment)
- lmi_cache_blend_bad_requests_total{engine}      requests whose blend kv_transfer_params were malformed

``BlendWorkerStats`` (``blend.worker_jobs``; each worker rank, {engine,rank}; its
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

import logging
import threading
import time
from collections import defaultdict
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger(__name__)

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


class SchedulerMetrics:
    """Lookup counters of one scheduler (one data-parallel replica)."""

    def __init__(self, engine_label: str = "0", registry: CollectorRegistry | None = None) -> None:
        self.engine_label = engine_label
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ["engine"]
        self._lookups = Counter("lmi_cache_lookups", "Requests looked up (one per admission)", labels, registry=r)
        self._requested = Counter("lmi_cache_requested_tokens", "Prompt tokens of looked-up requests", labels,
                                  registry=r)
        self._hit = Counter("lmi_cache_hit_tokens", "Prompt tokens held by the cache", labels, registry=r)
        self._load = Counter("lmi_cache_load_tokens", "Tokens the workers were told to load", labels, registry=r)
        self._remote_lookups = Counter(
            "lmi_cache_remote_lookups", "Batched remote existence checks of the scheduler, by outcome "
            "(answered, or why not: timeout, unavailable)", ["engine", "outcome"], registry=r)
        self._releases = Counter("lmi_cache_session_releases", "Sessions whose chunks stopped being retained", labels,
                                 registry=r)
        tiers = ["engine", "tier"]
        self._tier_hits = Counter("lmi_cache_tier_hit_tokens", "Prompt tokens served at admission, by where they came "
                                  "from (gpu: vLLM's own prefix cache; cpu, disk, remote: loaded)", tiers, registry=r)
        self._misses = Counter("lmi_cache_miss_tokens", "Prompt tokens the caches could have served and did not, by "
                               "reason (not_stored, evicted, failed_load, key_mismatch)", ["engine", "reason"],
                               registry=r)
        self._evictions = Counter("lmi_cache_placement_evictions", "Entries the placement directory evicted, by tier",
                                  tiers, registry=r)
        self._unplanned = Counter("lmi_cache_placement_unplanned_stores", "Stores a worker reported that the "
                                  "placement directory never planned (refused and removed again; a bug), by tier",
                                  tiers, registry=r)
        self._evicted_pending = Counter(
            "lmi_cache_placement_evicted_before_confirm", "Stores the placement directory planned and evicted before "
            "the worker confirmed them (asynchronous scheduling; removed again), by tier", tiers, registry=r)
        self._dropped = Counter("lmi_cache_placement_dropped", "Entries a worker's tier lost on its own (damaged, "
                                "unreadable, a full filesystem), by tier", tiers, registry=r)
        self._entries = Gauge("lmi_cache_placement_entries", "Entries the placement directory holds, all ranks, by tier",
                              tiers, registry=r, multiprocess_mode=_GAUGE_MODE)
        self._retained = Gauge("lmi_cache_session_retained_bytes", "Bytes of open sessions' chunks evicted last, all "
                               "ranks, by tier", tiers, registry=r, multiprocess_mode=_GAUGE_MODE)

        # The scheduler's own counts (``SchedulerSide.stats`` reads them back: each is kept once, here).
        self._steps = {name: Counter(series, doc, labels, registry=r) for name, series, doc in (
            ("match_queries", "lmi_cache_scheduler_match_queries",
             "Calls of get_num_new_matched_tokens, re-asks of waiting requests included"),
            ("hit_requests", "lmi_cache_scheduler_hit_requests", "Requests admitted with a load from the cache"),
            ("planned_saves", "lmi_cache_scheduler_planned_saves", "Chunk saves planned for the workers"),
            ("preemptions", "lmi_cache_scheduler_preemptions", "Requests vLLM preempted"),
            ("remote_checks", "lmi_cache_scheduler_remote_checks", "Batched remote existence checks sent"),
            ("remote_hit_chunks", "lmi_cache_scheduler_remote_hit_chunks",
             "Chunks a remote existence check found beyond the local hit"),
            ("peer_checks", "lmi_cache_scheduler_peer_checks", "Batched peer existence checks sent"),
            ("peer_hit_chunks", "lmi_cache_scheduler_peer_hit_chunks",
             "Chunks a peer existence check found beyond the local hit"),
        )}
        self._peer_lookups = Counter(
            "lmi_cache_peer_lookups", "Batched peer existence checks of the scheduler, by outcome "
            "(answered, or why not: timeout, unreachable, refused, bad_reply; without a hint: no_holder, "
            "store_down)", ["engine", "outcome"], registry=r)

    def count(self, name: str, amount: float = 1) -> None:
        """One of the scheduler's own counts (see ``_steps``) grows by ``amount``."""
        if amount:
            self._steps[name].labels(self.engine_label).inc(amount)

    def value(self, name: str) -> float:
        """A series of this scheduler read back from its registry (0 before its first count)."""
        return self.registry.get_sample_value(name, {"engine": self.engine_label}) or 0.0

    def evicted(self, tier: str, count: int) -> None:
        self._evictions.labels(self.engine_label, tier).inc(count)

    def unplanned_store(self, tier: str) -> None:
        self._unplanned.labels(self.engine_label, tier).inc()

    def evicted_before_confirm(self, tier: str) -> None:
        self._evicted_pending.labels(self.engine_label, tier).inc()

    def dropped(self, tier: str, count: int) -> None:
        self._dropped.labels(self.engine_label, tier).inc(count)

    def placement(self, tier: str, entries: int, retained_bytes: int) -> None:
        self._entries.labels(self.engine_label, tier).set(entries)
        self._retained.labels(self.engine_label, tier).set(retained_bytes)

    def unmirrored_lookup(self, kind: str, outcome: str, hit_chunks: int) -> None:
        """An existence check of the remote store or a peer (``kind``) answered (or given up: ``outcome``)."""
        (self._remote_lookups if kind == "remote" else self._peer_lookups).labels(self.engine_label, outcome).inc()
        self.count(f"{kind}_hit_chunks", hit_chunks)

    def lookup(self, requested_tokens: int, hit_tokens: int, load_tokens: int) -> None:
        self._lookups.labels(self.engine_label).inc()
        self._requested.labels(self.engine_label).inc(requested_tokens)
        self._hit.labels(self.engine_label).inc(hit_tokens)
        self._load.labels(self.engine_label).inc(load_tokens)

    def sessions_released(self, count: int) -> None:
        self._releases.labels(self.engine_label).inc(count)

    def tier_hit(self, tier: str, num_tokens: int) -> None:
        if num_tokens > 0:
            self._tier_hits.labels(self.engine_label, tier).inc(num_tokens)

    def missed(self, reason: str, num_tokens: int) -> None:
        if num_tokens > 0:
            self._misses.labels(self.engine_label, reason).inc(num_tokens)


class SchedulerStats:
    """The scheduler's counts, read back from its Prometheus series (each event is counted once, there)."""

    _SERIES = {
        "num_match_queries": "lmi_cache_scheduler_match_queries_total",
        "num_hit_requests": "lmi_cache_scheduler_hit_requests_total",
        "num_load_tokens": "lmi_cache_load_tokens_total",
        "num_planned_saves": "lmi_cache_scheduler_planned_saves_total",
        "num_preemptions": "lmi_cache_scheduler_preemptions_total",
        "num_remote_lookups": "lmi_cache_scheduler_remote_checks_total",
        "num_remote_hit_chunks": "lmi_cache_scheduler_remote_hit_chunks_total",
    }

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self._metrics = metrics

    def __getattr__(self, name: str) -> float:
        series = type(self)._SERIES.get(name)
        if series is None:
            raise AttributeError(name)
        return self._metrics.value(series)

    def snapshot(self) -> dict[str, float]:
        return {name: self._metrics.value(series) for name, series in self._SERIES.items()}


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


class BlendSchedulerMetrics:
    """Blend counters of one scheduler, in the registry of its ``SchedulerMetrics`` (label ``engine``)."""

    def __init__(self, registry: CollectorRegistry, engine_label: str = "0") -> None:
        self.engine_label = engine_label
        self.registry = registry
        labels = ["engine"]
        self._requests = Counter("lmi_cache_blend_planned_requests", "Requests admitted with a blend", labels,
                                 registry=registry)
        self._tokens = Counter("lmi_cache_blend_planned_tokens", "Tokens blends serve from cached segments", labels,
                               registry=registry)
        self._stores = Counter("lmi_cache_blend_segment_stores", "Segment stores issued to the workers", labels,
                               registry=registry)
        self._bad = Counter("lmi_cache_blend_bad_requests", "Requests with malformed blend kv_transfer_params",
                            labels, registry=registry)
        for counter in (self._requests, self._tokens, self._stores, self._bad):
            counter.labels(engine_label)  # present at 0 from the start: rates work before the first blend

    def blended(self, num_tokens: int) -> None:
        self._requests.labels(self.engine_label).inc()
        self._tokens.labels(self.engine_label).inc(num_tokens)

    def segment_stores(self, count: int = 1) -> None:
        self._stores.labels(self.engine_label).inc(count)

    def bad_request(self) -> None:
        self._bad.labels(self.engine_label).inc()

    def counts(self) -> dict[str, float]:
        """The counts above by their ``BlendSchedulerStats`` names, read from the series (kept nowhere else)."""
        labels = {"engine": self.engine_label}
        return {field: self.registry.get_sample_value(f"{name}_total", labels) or 0.0 for field, name in (
            ("num_blend_plans", "lmi_cache_blend_planned_requests"), ("num_blend_tokens", "lmi_cache_blend_planned_tokens"),
            ("num_segment_stores", "lmi_cache_blend_segment_stores"), ("num_bad_requests", "lmi_cache_blend_bad_requests"))}


class RateLimitedWarner:
    """Logs each kind of warning at most once per ``interval_s`` (faults can repeat per chunk)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._suppressed[kind] += 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        extra = f" ({suppressed} similar suppressed)" if suppressed else ""
        self._logger.warning("%s%s", message, extra)
