"""Counts of one worker rank, each kept once: in a prometheus_client Counter (vLLM worker processes).

A class of counts (``WorkerStats``, ``BlendWorkerStats``) declares each count
as a :class:`Count` with its series. The number lives only in that counter's
child labelled ``engine`` and ``rank``: ``stats.add(BlendWorkerStats.num_blends)``
adds 1 to the counter (as cheap as the counter's own ``inc``), and reading
``stats.num_blends`` reads it back (``Counter.collect``, some microseconds), so
what a log, a test or a benchmark reads is the series ``/metrics`` serves.
Under vLLM the counters write ``PROMETHEUS_MULTIPROC_DIR``'s per-process files
like every other lmi-cache series (custom collectors would not be scraped there).

The counters are made with the object and join the rank engine's registry
(``CacheMetrics``: registry and labels) on :meth:`RankCounts.attach`, or on the
first count, asking ``metrics_of`` for the engine's metrics; with no engine they
count under this object alone. A metrics fault never breaks a step: the first
one turns the counts off on this rank with one warning.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, NoReturn, overload

from prometheus_client import Counter

if TYPE_CHECKING:
    from lmi_cache.metrics.worker_series import CacheMetrics

logger = logging.getLogger(__name__)

_LABELS = ("engine", "rank")


class Count:
    """One count of a :class:`RankCounts` class: its value is the series ``<name>_total`` of this rank."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        self.field = ""

    def __set_name__(self, owner: type, field: str) -> None:
        self.field = field

    @overload
    def __get__(self, obj: None, owner: type) -> Count: ...
    @overload
    def __get__(self, obj: RankCounts, owner: type) -> float: ...
    def __get__(self, obj: RankCounts | None, owner: type) -> Count | float:
        return self if obj is None else obj.value(self.field)

    def __set__(self, obj: RankCounts, value: NoReturn) -> None:
        # A data descriptor, so no instance attribute can shadow the counter (a second store); mypy refuses
        # ``stats.x += n`` too (it would read the counter on every event): counts grow through ``add``.
        raise AttributeError(f"{self.field} is a counter: add to it with .add({type(obj).__name__}.{self.field}, n)")


class RankCounts:
    """Base of a rank's counts; see the module docstring. ``what`` names them in the fault warning."""

    what: ClassVar[str] = "worker counts"

    def __init__(self, metrics_of: Callable[[], CacheMetrics | None] = lambda: None, rank_label: str = "0") -> None:
        self._metrics_of = metrics_of
        self._rank_label = rank_label
        self._counters = {c.field: Counter(c.name, c.documentation, _LABELS, registry=None) for c in self.counts()}
        self._children: dict[str, Counter] = {}  # field -> the counter's child of this rank, once attached
        self._labels: dict[str, str] = {}
        self.off = False

    @classmethod
    def counts(cls) -> tuple[Count, ...]:
        """The counts the class declares, in declaration order (base classes first)."""
        return tuple(v for klass in reversed(cls.__mro__) for v in vars(klass).values() if isinstance(v, Count))

    def attach(self, metrics: CacheMetrics | None) -> None:
        """Count in ``metrics``' registry with its labels (None: under this object alone); the first call wins."""
        if self._children or self.off:
            return
        try:
            ids = (metrics.engine_label, metrics.rank_label) if metrics is not None else ("0", self._rank_label)
            if metrics is not None:
                for counter in self._counters.values():
                    metrics.registry.register(counter)  # served by the rank's exporter with its other series
            # Present at 0 from the start: rates work before the first event.
            self._children = {field: counter.labels(*ids) for field, counter in self._counters.items()}
            self._labels = dict(zip(_LABELS, ids))
        except Exception as err:  # noqa: BLE001 - metrics must never break a step
            self._turn_off(err)

    def add(self, count: Count, amount: float = 1.0) -> None:
        """Add ``amount`` to ``count`` (a class attribute: ``stats.add(WorkerStats.load_bytes, n)``); thread-safe."""
        if not self._children:
            self.attach(self._metrics_of())
        if self.off:
            return
        try:
            self._children[count.field].inc(amount)  # a negative amount is refused (a counter only grows)
        except Exception as err:  # noqa: BLE001 - metrics must never break a step
            self._turn_off(err)

    def value(self, field: str) -> float:
        """The count of ``field`` on this rank (0 before the first count)."""
        if not self._labels:
            return 0.0
        for metric in self._counters[field].collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels == self._labels:
                    return sample.value
        return 0.0

    def snapshot(self) -> dict[str, float]:
        """Every count by field name (for logs, tests and benchmarks)."""
        return {field: self.value(field) for field in self._counters}

    def _turn_off(self, err: BaseException) -> None:
        self.off = True
        logger.warning("lmi-cache: %s turned off on this rank (%r)", self.what, err)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v:g}' for k, v in self.snapshot().items())})"
