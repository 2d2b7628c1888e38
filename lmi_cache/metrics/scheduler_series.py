"""Prometheus series of the scheduler (vLLM's engine-core process), one writer per data-parallel replica.

``SchedulerMetrics`` counts where every prompt is looked up. Labels: ``engine``
(the data-parallel replica, as in vLLM's own series); placement series also
``tier``. The worker ranks' series are in ``metrics.worker_series``; both
kinds share one ``/metrics`` (see ``metrics.worker_series`` for how several
processes' values are aggregated). Each object owns a CollectorRegistry
(several schedulers in one test process never collide) that the opt-in
exporters of ``metrics.server`` serve.

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

Blending series (``LmiCacheConnector`` with ``enable_blending`` on), in the
registry of the scheduler's object above, so with the same labels and the
same exporter. ``BlendSchedulerMetrics`` (scheduler, {engine}):

- lmi_cache_blend_planned_requests_total{engine}  requests admitted with a blend (vLLM accepted its tokens)
- lmi_cache_blend_planned_tokens_total{engine}    tokens those blends serve from cached segments
- lmi_cache_blend_segment_stores_total{engine}    segment stores issued to the workers (once per segment)
- lmi_cache_blend_bad_requests_total{engine}      requests whose blend kv_transfer_params were malformed
"""
from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge

# Several processes write one gauge name; each (engine, tier) is written by one process.
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
