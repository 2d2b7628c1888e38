"""The per-rank Prometheus exporter: port arithmetic, bad values, a real scrape."""
from __future__ import annotations

import socket
import urllib.request

import pytest

from lmi_cache.errors import ConfigError
from lmi_cache.metrics import CacheMetrics
from lmi_cache.metrics_server import metrics_port_for_rank, serve_metrics


def test_port_per_rank_and_off_by_default() -> None:
    assert metrics_port_for_rank(0, {}) is None
    assert metrics_port_for_rank(3, {"LMI_CACHE_METRICS_PORT": "9400"}) == 9403
    with pytest.raises(ConfigError, match="LMI_CACHE_METRICS_PORT"):
        metrics_port_for_rank(0, {"LMI_CACHE_METRICS_PORT": "nine"})
    with pytest.raises(ConfigError, match="out of range"):
        metrics_port_for_rank(1, {"LMI_CACHE_METRICS_PORT": "65535"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serves_the_engine_registry_and_survives_a_busy_port() -> None:
    metrics = CacheMetrics("1")
    metrics.lookup(512, {"cpu": 256})
    env = {"LMI_CACHE_METRICS_PORT": str(_free_port() - 1), "LMI_CACHE_METRICS_ADDR": "127.0.0.1"}
    port = serve_metrics(metrics.registry, 1, env)
    assert port is not None
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'lmi_cache_lookups_total{rank="1"} 1.0' in body
    assert 'lmi_cache_hit_tokens_total{rank="1",tier="cpu"} 256.0' in body
    # The same port again is busy: a warning and None, never an exception.
    assert serve_metrics(metrics.registry, 1, env) is None
