"""Metrics of two data-parallel replicas through vLLM's own OpenAI server (one server start for the module).

vLLM is started directly (not through ``lmi-cache serve``), the way a user
who sets ``PROMETHEUS_MULTIPROC_DIR`` themselves runs it, with
``--data-parallel-size 2``: two engine-core processes, each with its own
scheduler and worker. Checks that the serving port's /metrics carries the
lmi_cache_* series of both replicas apart (``engine`` label), that the
scheduler's load count agrees with vLLM's own external-hit count per replica,
and that the opt-in per-process exporters of both replicas answer on four distinct ports.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from server_process import running_server
from vllm_cache import vllm_cache_root

from tests.local_ports import free_port_block

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 420  # ~2 min on an idle 2-core machine for two engines
PROMPT = " ".join(f"replica{i} alpha beta" for i in range(300))  # about 2,400 tokens
NUM_REQUESTS = 6  # vLLM spreads them over both replicas; each replica sees the prompt at least twice
CONNECTOR = {"kv_connector": "LmiCacheConnector", "kv_connector_module_path": "lmi_cache.vllm_connector",
             "kv_role": "kv_both"}


@dataclass
class DpServer:
    url: str
    model: str
    exporter_base: int
    log_path: Path

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _samples(text: str, prefix: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


@pytest.fixture(scope="module")
def dp_server(tiny_model: Path, e2e_dir: Path) -> Iterator[DpServer]:
    root = Path(tempfile.mkdtemp(prefix="metrics-dp-", dir=e2e_dir))
    for sub in ("prometheus", "rpc", "vllm-cache"):
        (root / sub).mkdir()
    port, exporter_base = free_port_block(1), free_port_block(4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "PROMETHEUS_", "LMI_CACHE_"))}
    env.update({
        "PROMETHEUS_MULTIPROC_DIR": str(root / "prometheus"),
        "LMI_CACHE_METRICS_PORT": str(exporter_base),
        "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "true", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_RPC_BASE_PATH": str(root / "rpc"), "VLLM_CACHE_ROOT": vllm_cache_root(root),
        "HF_HUB_OFFLINE": "1",  # vLLM's own process layout for data parallel (no tests/vllm_cache.LEAN_VLLM_ENV)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
           "--enforce-eager", "--no-enable-prefix-caching", "--data-parallel-size", "2",
           "--kv-transfer-config", json.dumps(CONNECTOR)]
    log_path = root / "vllm.log"
    try:
        with running_server(cmd, env=env, log_path=log_path, ready_url=f"http://127.0.0.1:{port}/health",
                            sigterm_whole_group=True, ready_timeout_s=READY_TIMEOUT_S):
            yield DpServer(f"http://127.0.0.1:{port}", str(tiny_model), exporter_base, log_path)
    finally:
        shutil.rmtree(root / "rpc", ignore_errors=True)


@pytest.fixture(scope="module")
def after_requests(dp_server: DpServer) -> str:
    """/metrics after the same long prompt was sent NUM_REQUESTS times, one at a time."""
    body = json.dumps({"model": dp_server.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    for _ in range(NUM_REQUESTS):
        request = urllib.request.Request(f"{dp_server.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=180) as response:
            json.load(response)
        time.sleep(0.5)  # lets the store of a replica's first request land before its next one
    return _get(f"{dp_server.url}/metrics")


def test_each_replica_counts_its_own_lookups_and_hits(dp_server: DpServer, after_requests: str) -> None:
    lmi = _samples(after_requests, "lmi_cache_")
    external = _samples(after_requests, "vllm:external_prefix_cache_hits_total")
    lookups = [lmi.get(f'lmi_cache_lookups_total{{engine="{e}"}}', 0.0) for e in ("0", "1")]
    assert sum(lookups) == NUM_REQUESTS and all(lookups), f"{lmi}\n{dp_server.log_tail()}"
    for engine in ("0", "1"):
        load = lmi[f'lmi_cache_load_tokens_total{{engine="{engine}"}}']
        series = f'vllm:external_prefix_cache_hits_total{{engine="{engine}",model_name="{dp_server.model}"}}'
        vllm_hits = external[series]
        assert load == vllm_hits, f"replica {engine}: lmi-cache says {load} tokens loaded, vLLM {vllm_hits}"
        assert lmi[f'lmi_cache_loaded_tokens_total{{engine="{engine}",rank="0",tier="cpu"}}'] == load
        assert lmi[f'lmi_cache_hit_tokens_total{{engine="{engine}"}}'] >= load
        assert lmi[f'lmi_cache_tier_capacity_bytes{{engine="{engine}",rank="0",tier="cpu"}}'] == 0.5 * 2**30
    assert sum(lmi[f'lmi_cache_load_tokens_total{{engine="{e}"}}'] for e in ("0", "1")) > 0


def test_exporters_of_two_replicas_use_four_distinct_ports(dp_server: DpServer, after_requests: str) -> None:
    base = dp_server.exporter_base
    on_metrics = _samples(after_requests, "lmi_cache_")
    # Replica d: scheduler on base + 2d, its rank-0 worker on base + 2d + 1 (TP x PP = 1).
    for engine in (0, 1):
        scheduler = _samples(_get(f"http://127.0.0.1:{base + 2 * engine}/metrics"), "lmi_cache_lookups_total")
        assert scheduler == {f'lmi_cache_lookups_total{{engine="{engine}"}}':
                             on_metrics[f'lmi_cache_lookups_total{{engine="{engine}"}}']}
        worker = _samples(_get(f"http://127.0.0.1:{base + 2 * engine + 1}/metrics"), "lmi_cache_loaded_tokens_total")
        assert list(worker) == [f'lmi_cache_loaded_tokens_total{{engine="{engine}",rank="0",tier="cpu"}}']
