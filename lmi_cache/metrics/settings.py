"""Where the lmi_cache_* series are published: settings, port layout, multiprocess directory (torch-free).

Two ways out, both optional to configure:

* vLLM's own ``/metrics`` on the serving port. The series are written by the
  scheduler (vLLM's engine-core process) and by every worker process, not by
  the API server that answers ``/metrics``; prometheus-client's multiprocess
  mode joins them: with ``PROMETHEUS_MULTIPROC_DIR`` set before vLLM starts,
  every process writes its values to files there and vLLM's ``/metrics``
  aggregates the files. ``lmi-cache serve`` sets it to a private directory
  that it empties at each start (``multiproc_env``); a user who starts vLLM
  directly sets it to an empty directory of their own.
* Opt-in per-process exporters, ``LMI_CACHE_METRICS_PORT`` (base port) and
  ``LMI_CACHE_METRICS_ADDR`` (bind address, default 127.0.0.1): for deployments
  that cannot set the variable above. Ports never collide on one host:
  data-parallel replica ``d`` of a deployment with ``W`` = TP x PP ranks uses
  ``base + d*(W+1)`` for its scheduler and ``base + d*(W+1) + 1 + r`` for rank
  ``r``'s worker.

``lmi-cache serve`` checks both variables before vLLM starts (one line, exit
2); inside vLLM a bad value costs a warning and the exporter, never a worker.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from lmi_cache.errors import ConfigError

METRICS_PORT_ENV = "LMI_CACHE_METRICS_PORT"
METRICS_ADDR_ENV = "LMI_CACHE_METRICS_ADDR"
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
DEFAULT_METRICS_ADDR = "127.0.0.1"
MAX_PORT = 65535


@dataclass(frozen=True)
class ExporterSettings:
    """The per-process exporters: base port and bind address."""

    base_port: int
    addr: str

    def port_for(self, dp_rank: int, world_size: int, rank: int | None) -> int:
        """Scheduler (``rank`` None) or worker ``rank`` of data-parallel replica ``dp_rank``."""
        if dp_rank < 0 or world_size < 1 or (rank is not None and not 0 <= rank < world_size):
            raise ConfigError(f"no exporter port for dp_rank={dp_rank}, rank={rank} of {world_size} ranks")
        port = self.base_port + dp_rank * (world_size + 1) + (0 if rank is None else 1 + rank)
        if port > MAX_PORT:
            raise ConfigError(
                f"{METRICS_PORT_ENV}={self.base_port}: the exporter of data-parallel replica {dp_rank}"
                f"{'' if rank is None else f', rank {rank}'} would need port {port} (> {MAX_PORT}); "
                "set a lower base port"
            )
        return port


def exporter_settings(env: Mapping[str, str] | None = None) -> ExporterSettings | None:
    """The exporters' settings, or None when ``LMI_CACHE_METRICS_PORT`` is unset (the default)."""
    env = os.environ if env is None else env
    raw_port = env.get(METRICS_PORT_ENV, "").strip()
    raw_addr = env.get(METRICS_ADDR_ENV, "").strip()
    addr = raw_addr or DEFAULT_METRICS_ADDR
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        raise ConfigError(
            f"environment variable {METRICS_ADDR_ENV}={raw_addr!r}: not an IP address; set the address the "
            f"metrics exporters bind to, e.g. {DEFAULT_METRICS_ADDR} (this host only) or 0.0.0.0 (all interfaces)"
        ) from None
    if not raw_port:
        return None
    try:
        base = int(raw_port)
    except ValueError:
        base = -1
    if not 1 <= base <= MAX_PORT:
        raise ConfigError(
            f"environment variable {METRICS_PORT_ENV}={raw_port!r}: must be a TCP port number (1-{MAX_PORT}), "
            "the first of the per-process metrics ports; unset it to publish only on vLLM's /metrics"
        )
    return ExporterSettings(base, addr)


def multiproc_env(
    env: Mapping[str, str],
    runtime_dir: str | os.PathLike[str],
    serving_port: int,
    *,
    cache_on: bool = True,
    prepare: bool = False,
) -> dict[str, str]:
    """``lmi-cache serve``: check the metrics variables and return what vLLM's environment needs.

    Raises ConfigError (one line) for a bad ``LMI_CACHE_METRICS_PORT`` or
    ``LMI_CACHE_METRICS_ADDR``. With the cache on and ``PROMETHEUS_MULTIPROC_DIR``
    unset, adds it as ``<runtime_dir>/prometheus-<serving port>`` (one per
    port: two servers on one host never mix their files); with ``prepare``
    (not for a dry run) that directory is emptied and made private right away.
    A directory the user chose is left alone (vLLM's rule: theirs to empty).
    """
    exporter_settings(env)
    if not cache_on or env.get(MULTIPROC_DIR_ENV, "").strip():
        return {}
    path = str(Path(os.path.abspath(runtime_dir)) / f"prometheus-{serving_port}")
    if prepare:
        reset_multiproc_dir(path)
    return {MULTIPROC_DIR_ENV: path}


def reset_multiproc_dir(path: str | None) -> None:
    """Make ``path`` an empty private directory (right before vLLM starts; a no-op for None).

    Files left by a previous run would be added to this run's counters, so the
    directory is emptied; it must be ours (not a symlink, owned by us), or the
    start fails with one line.
    """
    if not path:
        return
    from lmi_cache.private_dir import UnsafeDirectoryError, ensure_private_dir

    try:
        target = ensure_private_dir(path)
        for entry in os.scandir(target):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
    except UnsafeDirectoryError as err:
        raise ConfigError(f"{MULTIPROC_DIR_ENV}: {err}") from None
    except OSError as err:
        raise ConfigError(f"{MULTIPROC_DIR_ENV}={path}: can't empty it ({err.strerror}); "
                          "remove it or set LMI_CACHE_RUNTIME_DIR to a writable directory") from None
