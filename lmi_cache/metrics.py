"""Prometheus metrics of one CacheEngine (vLLM worker process), plus a rate-limited warner.

Each CacheMetrics owns a CollectorRegistry (several engines in one process,
e.g. tests, never collide); the connector exposes ``metrics.registry``.
Every series carries a ``rank`` label; tier series also carry ``tier``.

Names (documented in the README):
- lmi_cache_lookups_total                      lookups (one per prompt)
- lmi_cache_requested_tokens_total             tokens asked for by lookups
- lmi_cache_hit_tokens_total{tier}             looked-up tokens found, by the tier that had them
- lmi_cache_stored_chunks_total{tier}          chunks stored
- lmi_cache_stored_tokens_total{tier}          tokens stored
- lmi_cache_stored_bytes_total{tier}           chunk-object bytes stored
- lmi_cache_evictions_total{tier}              chunks evicted to stay within the byte budget
- lmi_cache_dropped_stores_total{tier,reason}  stores refused (full, queue_full, too_large, error)
- lmi_cache_fingerprint_mismatches_total{tier} loads whose token fingerprint differed (a miss)
- lmi_cache_corrupted_reads_total{tier}        loads of damaged objects (a miss; file removed)
- lmi_cache_tier_errors_total{tier,op}         I/O faults (ENOSPC, EIO, EACCES, ...) turned into misses
- lmi_cache_tier_usage_bytes{tier}             bytes held now
- lmi_cache_tier_capacity_bytes{tier}          byte budget
- lmi_cache_load_seconds{tier}                 latency of a successful load (histogram)
- lmi_cache_store_seconds{tier}                latency of a store (CPU: copy; disk: file write)
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class CacheMetrics:
    """Counters and gauges of one engine; also kept as plain numbers for ``stats()``."""

    def __init__(self, rank_label: str = "0", registry: CollectorRegistry | None = None) -> None:
        self.rank_label = rank_label
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        rank = ["rank"]
        tier = ["rank", "tier"]
        self._lookups = Counter("lmi_cache_lookups", "Lookups (one per prompt)", rank, registry=r)
        self._requested = Counter("lmi_cache_requested_tokens", "Tokens asked for by lookups", rank, registry=r)
        self._hit = Counter("lmi_cache_hit_tokens", "Looked-up tokens found, by tier", tier, registry=r)
        self._chunks = Counter("lmi_cache_stored_chunks", "Chunks stored", tier, registry=r)
        self._tokens = Counter("lmi_cache_stored_tokens", "Tokens stored", tier, registry=r)
        self._bytes = Counter("lmi_cache_stored_bytes", "Chunk-object bytes stored", tier, registry=r)
        self._evictions = Counter("lmi_cache_evictions", "Chunks evicted for space", tier, registry=r)
        self._dropped = Counter(
            "lmi_cache_dropped_stores", "Stores refused", ["rank", "tier", "reason"], registry=r
        )
        self._fp = Counter("lmi_cache_fingerprint_mismatches", "Loads with a foreign fingerprint", tier, registry=r)
        self._corrupt = Counter("lmi_cache_corrupted_reads", "Loads of damaged objects", tier, registry=r)
        self._errors = Counter("lmi_cache_tier_errors", "I/O faults turned into misses", ["rank", "tier", "op"], registry=r)
        self._usage = Gauge("lmi_cache_tier_usage_bytes", "Bytes held", tier, registry=r)
        self._capacity = Gauge("lmi_cache_tier_capacity_bytes", "Byte budget", tier, registry=r)
        self._load_s = Histogram("lmi_cache_load_seconds", "Load latency", tier, buckets=_LATENCY_BUCKETS_S, registry=r)
        self._store_s = Histogram(
            "lmi_cache_store_seconds", "Store latency", tier, buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self._lock = threading.Lock()
        self._plain: dict[str, float] = defaultdict(float)

    def _add(self, name: str, amount: float = 1.0) -> None:
        with self._lock:
            self._plain[name] += amount

    def lookup(self, requested_tokens: int, hit_tokens_by_tier: dict[str, int]) -> None:
        self._lookups.labels(self.rank_label).inc()
        self._requested.labels(self.rank_label).inc(requested_tokens)
        self._add("lookups")
        self._add("requested_tokens", requested_tokens)
        for tier, tokens in hit_tokens_by_tier.items():
            self._hit.labels(self.rank_label, tier).inc(tokens)
            self._add(f"{tier}_hit_tokens", tokens)

    def stored(self, tier: str, num_tokens: int, num_bytes: int, seconds: float) -> None:
        self._chunks.labels(self.rank_label, tier).inc()
        self._tokens.labels(self.rank_label, tier).inc(num_tokens)
        self._bytes.labels(self.rank_label, tier).inc(num_bytes)
        self._store_s.labels(self.rank_label, tier).observe(seconds)
        self._add(f"{tier}_stored_chunks")
        self._add(f"{tier}_stored_bytes", num_bytes)

    def loaded(self, tier: str, seconds: float) -> None:
        self._load_s.labels(self.rank_label, tier).observe(seconds)
        self._add(f"{tier}_loads")

    def evicted(self, tier: str, num_chunks: int = 1) -> None:
        self._evictions.labels(self.rank_label, tier).inc(num_chunks)
        self._add(f"{tier}_evictions", num_chunks)

    def dropped(self, tier: str, reason: str) -> None:
        self._dropped.labels(self.rank_label, tier, reason).inc()
        self._add(f"{tier}_dropped_stores")
        self._add(f"{tier}_dropped_{reason}")

    def fingerprint_mismatch(self, tier: str) -> None:
        self._fp.labels(self.rank_label, tier).inc()
        self._add(f"{tier}_fingerprint_mismatches")

    def corrupted(self, tier: str) -> None:
        self._corrupt.labels(self.rank_label, tier).inc()
        self._add(f"{tier}_corrupted_reads")

    def error(self, tier: str, op: str) -> None:
        self._errors.labels(self.rank_label, tier, op).inc()
        self._add(f"{tier}_errors_{op}")

    def usage(self, tier: str, used_bytes: int, capacity_bytes: int) -> None:
        self._usage.labels(self.rank_label, tier).set(used_bytes)
        self._capacity.labels(self.rank_label, tier).set(capacity_bytes)
        with self._lock:
            self._plain[f"{tier}_usage_bytes"] = used_bytes
            self._plain[f"{tier}_capacity_bytes"] = capacity_bytes

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._plain)


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
