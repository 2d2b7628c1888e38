"""Opt-in per-process Prometheus exporters (vLLM scheduler and worker processes).

The usual place for the lmi_cache_* series is vLLM's own ``/metrics`` (see
``lmi_cache.metrics.settings``). When ``LMI_CACHE_METRICS_PORT`` is set, each
process that writes series also serves its own registry: the scheduler of
data-parallel replica ``d`` and each worker rank, on the collision-free ports
``ExporterSettings.port_for`` computes, bound to ``LMI_CACHE_METRICS_ADDR``
(default 127.0.0.1). A bad setting or a busy port costs a warning and the
exporter, never the server.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

from prometheus_client import CollectorRegistry, start_http_server

from lmi_cache.errors import ConfigError
from lmi_cache.metrics.settings import METRICS_PORT_ENV, MULTIPROC_DIR_ENV, ExporterSettings, exporter_settings

logger = logging.getLogger(__name__)


def serve_metrics(
    registry: CollectorRegistry,
    *,
    dp_rank: int,
    world_size: int,
    rank: int | None,
    env: Mapping[str, str] | None = None,
) -> int | None:
    """Start this process's exporter if configured; return the bound port or None.

    ``rank`` is None for the scheduler, else the worker's TP/PP rank.
    """
    who = "scheduler" if rank is None else f"rank {rank}"
    try:
        settings = exporter_settings(env)
        if settings is None:
            return None
        port = settings.port_for(dp_rank, world_size, rank)
    except ConfigError as err:
        logger.warning("lmi-cache: metrics exporter of %s off: %s", who, err)
        return None
    try:
        start_http_server(port, addr=settings.addr, registry=registry)
    except OSError as err:
        logger.warning("lmi-cache: metrics of %s not served on %s:%d (%s); the cache works without them",
                       who, settings.addr, port, err)
        return None
    logger.info("lmi-cache: metrics of data-parallel replica %d, %s on http://%s:%d/metrics",
                dp_rank, who, settings.addr, port)
    return port


def note_where_metrics_go(env: Mapping[str, str] | None = None) -> None:
    """Says once, at the scheduler's start-up, where users find the lmi_cache_* series.

    A warning when vLLM's /metrics can't carry them (vLLM logs only its own
    loggers' info lines, and a user scraping /metrics would see nothing).
    """
    env = os.environ if env is None else env
    if env.get(MULTIPROC_DIR_ENV, "").strip():
        logger.info("lmi-cache: lmi_cache_* series are published on vLLM's /metrics (prometheus multiprocess mode)")
        return
    if _exporter_settings_or_none(env) is not None:
        logger.info("lmi-cache: lmi_cache_* series only on the per-process exporters (%s)", METRICS_PORT_ENV)
        return
    logger.warning(
        "lmi-cache: PROMETHEUS_MULTIPROC_DIR is unset, so vLLM's /metrics can't show the lmi_cache_* series "
        "(they are written by the engine and worker processes); set it to an empty directory before starting "
        "vLLM (lmi-cache serve does), or set %s for per-process exporters", METRICS_PORT_ENV)


def _exporter_settings_or_none(env: Mapping[str, str]) -> ExporterSettings | None:
    try:
        return exporter_settings(env)
    except ConfigError:
        return None
