"""Expose one engine's Prometheus registry over HTTP (vLLM worker process).

The engine lives in vLLM's worker processes, not in the API server, so its
metrics can't ride on vLLM's own ``/metrics``. When ``LMI_CACHE_METRICS_PORT``
is set, rank ``r`` serves its registry on ``port + r`` (one port per rank,
scraped side by side). A port that can't be bound costs a warning, never the
server.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

from prometheus_client import CollectorRegistry, start_http_server

from lmi_cache.errors import ConfigError

logger = logging.getLogger(__name__)

METRICS_PORT_ENV = "LMI_CACHE_METRICS_PORT"


def metrics_port_for_rank(rank: int, env: Mapping[str, str] | None = None) -> int | None:
    """The port rank ``rank`` should serve on, or None when metrics serving is off."""
    raw = (env if env is not None else os.environ).get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        base = int(raw)
    except ValueError:
        raise ConfigError(f"{METRICS_PORT_ENV}={raw!r}: not a port number; set an integer such as 9400") from None
    if not 1 <= base + rank <= 65535:
        raise ConfigError(f"{METRICS_PORT_ENV}={base}: port {base + rank} for rank {rank} is out of range")
    return base + rank


def serve_metrics(registry: CollectorRegistry, rank: int, env: Mapping[str, str] | None = None) -> int | None:
    """Start the HTTP exporter for ``registry`` if configured; return the bound port or None."""
    port = metrics_port_for_rank(rank, env)
    if port is None:
        return None
    addr = (env if env is not None else os.environ).get("LMI_CACHE_METRICS_ADDR", "0.0.0.0")
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as err:
        logger.warning("lmi-cache metrics not served on %s:%d (%s); the cache works without them", addr, port, err)
        return None
    logger.info("lmi-cache metrics of rank %d on http://%s:%d/metrics", rank, addr, port)
    return port
