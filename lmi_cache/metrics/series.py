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
- lmi_cache_placement_evictions_total{engine,tier} entries the placement directory evicted (every rank's)
- lmi_cache_placement_dropped_total{engine,tier}  entries a worker's tier lost on its own (damaged or
                                                  unreadable, a full filesystem, over its budget)
- lmi_cache_placement_entries{engine,tier}        entries the directory holds now (every rank's)
- lmi_cache_session_retained_bytes{engine,tier}   bytes of open sessions' chunks evicted last (within
                                                  extra_config.session_retention_share of the tier)

Worker series (per rank; with TP every rank holds its own part of each token's KV):

- lmi_cache_loaded_tokens_total{tier}             tokens of chunks read back from the tier
- lmi_cache_stored_chunks_total{tier}             chunks stored
- lmi_cache_stored_tokens_total{tier}             tokens stored
- lmi_cache_stored_bytes_total{tier}              chunk-object bytes stored
- lmi_cache_evictions_total{tier}                 chunks evicted (as the placement directory decided, or,
                                                  as a safety net, by a tier over its own budget)
- lmi_cache_dropped_stores_total{tier,reason}     stores refused (full, queue_full, too_large, error)
- lmi_cache_fingerprint_mismatches_total{tier}    loads whose token fingerprint differed (a miss)
- lmi_cache_corrupted_reads_total{tier}           loads of damaged objects (a miss; file removed)
- lmi_cache_tier_errors_total{tier,op}            faults turned into misses (ENOSPC, EIO, a missing chunk, ...)
- lmi_cache_untrusted_files_total{tier,reason}    entries ignored as not ours (symlink, not_regular,
                                                  foreign_owner) and directories refused (unsafe_dir, busy_dir)
- lmi_cache_tier_usage_bytes{tier}                bytes held now
- lmi_cache_tier_capacity_bytes{tier}             byte budget
- lmi_cache_load_seconds{tier}                    latency of a successful load (histogram)
- lmi_cache_store_seconds{tier}                   latency of a store (CPU: copy; disk: file write)

Blending series (``LmiCacheConnector`` with ``enable_blending`` on), in the
registry of the scheduler's or the rank's object above, so with the same labels
and the same exporter. ``BlendSchedulerMetrics`` (scheduler, {engine}):

- lmi_cache_blend_planned_requests_total{engine}  requests admitted with a blend (vLLM accepted its tokens)
- lmi_cache_blend_planned_tokens_total{engine}    tokens those blends serve from cached segments
- lmi_cache_blend_segment_stores_total{engine}    segment stores issued to the workers (once per segment)
- lmi_cache_blend_bad_requests_total{engine}      requests whose blend kv_transfer_params were malformed

``BlendWorkerMetrics`` (each worker rank, {engine,rank}; the worker's own
``BlendWorkerStats`` added after every step):

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
from collections.abc import Callable
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Several processes write one gauge name; each (engine, rank, tier) is written by one process.
_GAUGE_MODE: Final = "mostrecent"


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
        self._evictions = Counter("lmi_cache_placement_evictions", "Entries the placement directory evicted, by tier",
                                  tiers, registry=r)
        self._dropped = Counter("lmi_cache_placement_dropped", "Entries a worker's tier lost on its own (damaged, "
                                "unreadable, a full filesystem), by tier", tiers, registry=r)
        self._entries = Gauge("lmi_cache_placement_entries", "Entries the placement directory holds, all ranks, by tier",
                              tiers, registry=r, multiprocess_mode=_GAUGE_MODE)
        self._retained = Gauge("lmi_cache_session_retained_bytes", "Bytes of open sessions' chunks evicted last, all "
                               "ranks, by tier", tiers, registry=r, multiprocess_mode=_GAUGE_MODE)

    def evicted(self, tier: str, count: int) -> None:
        self._evictions.labels(self.engine_label, tier).inc(count)

    def dropped(self, tier: str, count: int) -> None:
        self._dropped.labels(self.engine_label, tier).inc(count)

    def placement(self, tier: str, entries: int, retained_bytes: int) -> None:
        self._entries.labels(self.engine_label, tier).set(entries)
        self._retained.labels(self.engine_label, tier).set(retained_bytes)

    def remote_lookup(self, outcome: str) -> None:
        self._remote_lookups.labels(self.engine_label, outcome).inc()

    def lookup(self, requested_tokens: int, hit_tokens: int, load_tokens: int) -> None:
        self._lookups.labels(self.engine_label).inc()
        self._requested.labels(self.engine_label).inc(requested_tokens)
        self._hit.labels(self.engine_label).inc(hit_tokens)
        self._load.labels(self.engine_label).inc(load_tokens)

    def sessions_released(self, count: int) -> None:
        self._releases.labels(self.engine_label).inc(count)


class CacheMetrics:
    """Counters and gauges of one engine (one worker rank); also kept as plain numbers for ``stats()``."""

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
        self._lock = threading.Lock()
        self._plain: dict[str, float] = defaultdict(float)

    def _add(self, name: str, amount: float = 1.0) -> None:
        with self._lock:
            self._plain[name] += amount

    def stored(self, tier: str, num_tokens: int, num_bytes: int, seconds: float) -> None:
        self._chunks.labels(*self._ids, tier).inc()
        self._tokens.labels(*self._ids, tier).inc(num_tokens)
        self._bytes.labels(*self._ids, tier).inc(num_bytes)
        self._store_s.labels(*self._ids, tier).observe(seconds)
        self._add(f"{tier}_stored_chunks")
        self._add(f"{tier}_stored_bytes", num_bytes)

    def loaded(self, tier: str, seconds: float) -> None:
        self._load_s.labels(*self._ids, tier).observe(seconds)
        self._add(f"{tier}_loads")

    def loaded_tokens(self, tier: str, num_tokens: int) -> None:
        self._loaded.labels(*self._ids, tier).inc(num_tokens)
        self._add(f"{tier}_loaded_tokens", num_tokens)

    def evicted(self, tier: str, num_chunks: int = 1) -> None:
        self._evictions.labels(*self._ids, tier).inc(num_chunks)
        self._add(f"{tier}_evictions", num_chunks)

    def dropped(self, tier: str, reason: str) -> None:
        self._dropped.labels(*self._ids, tier, reason).inc()
        self._add(f"{tier}_dropped_stores")
        self._add(f"{tier}_dropped_{reason}")

    def fingerprint_mismatch(self, tier: str) -> None:
        self._fp.labels(*self._ids, tier).inc()
        self._add(f"{tier}_fingerprint_mismatches")

    def corrupted(self, tier: str) -> None:
        self._corrupt.labels(*self._ids, tier).inc()
        self._add(f"{tier}_corrupted_reads")

    def error(self, tier: str, op: str) -> None:
        self._errors.labels(*self._ids, tier, op).inc()
        self._add(f"{tier}_errors_{op}")

    def untrusted(self, tier: str, reason: str) -> None:
        self._untrusted.labels(*self._ids, tier, reason).inc()
        self._add(f"{tier}_untrusted_{reason}")

    def usage(self, tier: str, used_bytes: int, capacity_bytes: int) -> None:
        self._usage.labels(*self._ids, tier).set(used_bytes)
        self._capacity.labels(*self._ids, tier).set(capacity_bytes)
        with self._lock:
            self._plain[f"{tier}_usage_bytes"] = used_bytes
            self._plain[f"{tier}_capacity_bytes"] = capacity_bytes

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._plain)


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


# BlendWorkerStats field -> (series name without _total, help). The worker counts in plain fields; these
# counters follow them (BlendWorkerMetrics.follow), so blending code stays free of Prometheus.
BLEND_WORKER_SERIES: Final = (
    ("num_blends", "lmi_cache_blend_jobs", "Blends written into vLLM's KV cache"),
    ("num_blend_faults", "lmi_cache_blend_job_faults", "Blends given back to vLLM to recompute"),
    ("num_segments_loaded", "lmi_cache_blend_segments_loaded", "Cached segments read back for blends"),
    ("num_segment_misses", "lmi_cache_blend_segment_misses", "Segments planned as cached but missing or damaged"),
    ("num_blended_tokens", "lmi_cache_blend_blended_tokens", "Tokens whose KV came from cached segments"),
    ("num_recomputed_tokens", "lmi_cache_blend_recomputed_tokens", "Blended tokens recomputed past the check layers"),
    ("num_segments_stored", "lmi_cache_blend_segments_stored", "Segments computed alone and stored"),
    ("num_segment_store_faults", "lmi_cache_blend_segment_store_faults", "Segment stores that failed"),
    ("num_native_attention_layers", "lmi_cache_blend_native_attention_layers",
     "Layers whose recomputed tokens lmi-cache's native CPU kernel attended (the rest: vLLM's kernel)"),
    ("num_layer0_reused_tokens", "lmi_cache_blend_layer0_reused_tokens",
     "Blended tokens whose layer-0 attention within their segment came from the segment's stored attention"),
    ("num_layer0_attention_stored", "lmi_cache_blend_layer0_attention_stored",
     "Segments whose layer-0 attention over themselves was stored beside their KV"),
    ("blend_seconds", "lmi_cache_blend_seconds", "Seconds spent blending (loads and KV writes included)"),
    ("blend_load_seconds", "lmi_cache_blend_load_seconds", "Seconds of blending spent reading prefix and segments"),
    ("blend_write_seconds", "lmi_cache_blend_write_seconds", "Seconds of blending spent writing KV into vLLM's cache"),
    ("store_seconds", "lmi_cache_blend_segment_store_seconds", "Seconds spent computing and storing segments"),
)


# WorkerStats field -> (series, help): the connector's own time on vLLM's model thread, which no tier
# series shows (a save's gather and a load's wait for its reads and copies happen between forward passes).
WORKER_SERIES: Final = (
    ("save_seconds", "lmi_cache_worker_save_seconds",
     "Seconds the model thread spent gathering and storing chunks after forward passes"),
    ("load_seconds", "lmi_cache_worker_load_seconds",
     "Seconds the model thread spent reading hits and copying them into vLLM's KV cache"),
)


class FollowedCounters:
    """Counters of one worker rank that follow a plain stats object, in its engine's registry (``engine``, ``rank``).

    Worker code counts in plain dataclass fields (free of Prometheus);
    ``follow`` adds what each field grew by since the last call.
    """

    def __init__(self, series: tuple[tuple[str, str, str], ...], registry: CollectorRegistry,
                 engine_label: str = "0", rank_label: str = "0") -> None:
        self.registry = registry
        self.engine_label = engine_label
        self.rank_label = rank_label
        self._counters = {field: Counter(name, text, ["engine", "rank"], registry=registry)
                          for field, name, text in series}
        self._seen: dict[str, float] = {field: 0.0 for field in self._counters}
        for counter in self._counters.values():
            counter.labels(engine_label, rank_label)  # present at 0 from the start

    def follow(self, stats: Any) -> None:
        """Add what ``stats`` counted since the last call."""
        for field, counter in self._counters.items():
            value = float(getattr(stats, field, 0) or 0)
            delta = value - self._seen[field]
            if delta > 0:
                counter.labels(self.engine_label, self.rank_label).inc(delta)
            self._seen[field] = value  # a smaller value: the stats were reset; count from there


class BlendWorkerMetrics(FollowedCounters):
    """Blend counters of one worker rank (``BlendWorkerStats`` fields, ``BLEND_WORKER_SERIES``)."""

    def __init__(self, registry: CollectorRegistry, engine_label: str = "0", rank_label: str = "0") -> None:
        super().__init__(BLEND_WORKER_SERIES, registry, engine_label, rank_label)


class StatsFollower:
    """A worker's plain stats followed into counters of its engine's registry, once per step.

    The counters are made on the first ``follow`` that finds the engine's metrics
    (``CacheMetrics``: registry and labels); the first fault turns the follower off
    with one warning naming ``what``, since metrics must never break a step.
    """

    def __init__(self, make: Callable[[Any], FollowedCounters], what: str) -> None:
        self._make = make  # engine metrics -> counters
        self._what = what
        self._counters: FollowedCounters | None = None
        self.off = False

    def follow(self, engine_metrics: Any, stats: Any) -> None:
        if self.off:
            return
        try:
            if self._counters is None:
                if getattr(engine_metrics, "registry", None) is None:
                    return  # no engine (or a stand-in without metrics) yet: try again next step
                self._counters = self._make(engine_metrics)
            self._counters.follow(stats)
        except Exception as err:  # noqa: BLE001 - metrics must never break a step
            self.off = True  # warned once; the counts stay in the plain stats
            logger.warning("lmi-cache: %s turned off on this rank (%r)", self._what, err)


def worker_stats_follower() -> StatsFollower:
    """The exact-prefix connector's worker seconds (``WorkerStats`` fields, ``WORKER_SERIES``)."""
    return StatsFollower(lambda m: FollowedCounters(WORKER_SERIES, m.registry, m.engine_label, m.rank_label),
                         "worker metrics")


def blend_stats_follower() -> StatsFollower:
    """The blend worker's counters (``BlendWorkerStats`` fields, ``BLEND_WORKER_SERIES``)."""
    return StatsFollower(lambda m: BlendWorkerMetrics(m.registry, m.engine_label, m.rank_label), "blend metrics")


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
