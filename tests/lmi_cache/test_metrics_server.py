"""The opt-in per-process exporters: collision-free ports, safe bind default, bad values as warnings."""
from __future__ import annotations

import logging
import socket
import urllib.request
from pathlib import Path

import pytest

from tests.local_ports import free_port_block

from lmi_cache.metrics.scheduler_series import SchedulerMetrics
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.metrics.server import note_where_metrics_go, serve_metrics


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_off_by_default() -> None:
    assert serve_metrics(CacheMetrics().registry, dp_rank=0, world_size=1, rank=0, env={}) is None


def test_scheduler_and_ranks_of_two_replicas_never_collide() -> None:
    """Two data-parallel replicas of a TP=2 deployment: 6 exporters, 6 distinct ports, each its own series."""
    base = free_port_block(6)
    env = {"LMI_CACHE_METRICS_PORT": str(base)}
    ports: dict[tuple[int, int | None], int | None] = {}
    for dp in (0, 1):
        sched = SchedulerMetrics(engine_label=str(dp))
        sched.lookup(100 + dp, 0, 0)
        ports[(dp, None)] = serve_metrics(sched.registry, dp_rank=dp, world_size=2, rank=None, env=env)
        for rank in (0, 1):
            worker = CacheMetrics(str(rank), engine_label=str(dp))
            worker.loaded_tokens("cpu", 10 * dp + rank)
            ports[(dp, rank)] = serve_metrics(worker.registry, dp_rank=dp, world_size=2, rank=rank, env=env)
    assert ports == {(0, None): base, (0, 0): base + 1, (0, 1): base + 2,
                     (1, None): base + 3, (1, 0): base + 4, (1, 1): base + 5}
    assert 'lmi_cache_requested_tokens_total{engine="1"} 101.0' in _scrape(base + 3)
    assert 'lmi_cache_loaded_tokens_total{engine="1",rank="1",tier="cpu"} 11.0' in _scrape(base + 5)


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses listening on ``port``, from /proc/net/tcp (Linux)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr_hex, port_hex = local.split(":")
        if int(port_hex, 16) == port and state == "0A":  # LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(addr_hex)[::-1]))
    return found


def test_binds_loopback_unless_told_otherwise() -> None:
    base = free_port_block(2)
    assert serve_metrics(CacheMetrics().registry, dp_rank=0, world_size=1, rank=None,
                         env={"LMI_CACHE_METRICS_PORT": str(base)}) == base
    assert _listening_addresses(base) == {"127.0.0.1"}
    env = {"LMI_CACHE_METRICS_PORT": str(base), "LMI_CACHE_METRICS_ADDR": "0.0.0.0"}
    assert serve_metrics(CacheMetrics().registry, dp_rank=0, world_size=1, rank=0, env=env) == base + 1
    assert _listening_addresses(base + 1) == {"0.0.0.0"}
    assert "lmi_cache" in _scrape(base)


@pytest.mark.parametrize("env, says", [
    ({"LMI_CACHE_METRICS_PORT": "abc"}, "LMI_CACHE_METRICS_PORT='abc'"),
    ({"LMI_CACHE_METRICS_PORT": "9400", "LMI_CACHE_METRICS_ADDR": "everywhere"}, "LMI_CACHE_METRICS_ADDR"),
    ({"LMI_CACHE_METRICS_PORT": "65535"}, "65536"),
])
def test_bad_settings_cost_a_warning_not_the_worker(
    env: dict[str, str], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert serve_metrics(CacheMetrics().registry, dp_rank=0, world_size=1, rank=0, env=env) is None
    assert says in caplog.text


def test_a_busy_port_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    base = free_port_block(1)
    env = {"LMI_CACHE_METRICS_PORT": str(base)}
    assert serve_metrics(CacheMetrics().registry, dp_rank=0, world_size=1, rank=None, env=env) == base
    with caplog.at_level(logging.WARNING):
        assert serve_metrics(CacheMetrics().registry, dp_rank=0, world_size=1, rank=None, env=env) is None
    assert "not served" in caplog.text


def test_start_up_note_says_where_the_series_are(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lmi_cache.metrics.server"):
        note_where_metrics_go({"PROMETHEUS_MULTIPROC_DIR": "/x"})
        note_where_metrics_go({"LMI_CACHE_METRICS_PORT": "9400"})
        note_where_metrics_go({})
    assert [(r.levelname, r.getMessage().split(",")[0]) for r in caplog.records] == [
        ("INFO", "lmi-cache: lmi_cache_* series are published on vLLM's /metrics (prometheus multiprocess mode)"),
        ("INFO", "lmi-cache: lmi_cache_* series only on the per-process exporters (LMI_CACHE_METRICS_PORT)"),
        ("WARNING", "lmi-cache: PROMETHEUS_MULTIPROC_DIR is unset"),
    ]
