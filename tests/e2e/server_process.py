"""Start an HTTP server subprocess (lmi-cache serve or vLLM) for e2e tests, wait until it answers, stop it.

The server runs in its own session so that stopping it also stops vLLM's
engine and worker processes; its output goes to a log whose tail is shown
when it fails to start (test process). ``front_vllm_server`` starts vLLM's
OpenAI server with the connector and the LMI front door, sessions on.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.local_ports import free_port_block
from vllm_cache import LEAN_VLLM_ENV, vllm_cache_root

REPO = Path(__file__).resolve().parents[2]
CONNECTOR = {"kv_connector": "LmiCacheConnector", "kv_connector_module_path": "lmi_cache.vllm_connector",
             "kv_role": "kv_both"}
READY_TIMEOUT_S = 300  # ~20 s on an idle 2-core machine; the shared CI machine can be much slower


def get_status(url: str) -> int:
    """HTTP status of a GET, 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def log_tail(log_path: Path, num_chars: int = 4000) -> str:
    return log_path.read_text(errors="replace")[-num_chars:]


def _stop(proc: subprocess.Popen[bytes], whole_group: bool) -> None:
    if proc.poll() is not None:
        return
    if whole_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)  # serve forwards it; its exit code is part of some tests
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: vLLM's engine and workers
        proc.wait(timeout=30)


@contextmanager
def running_server(
    cmd: list[str],
    *,
    env: dict[str, str],
    log_path: Path,
    ready_url: str,
    cwd: Path | None = None,
    sigterm_whole_group: bool = False,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` until the block ends; fail the test if ``ready_url`` does not answer 200 in time."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    try:
        started = time.monotonic()
        while get_status(ready_url) != 200:
            if proc.poll() is not None:
                pytest.fail(f"{cmd[0]} exited with {proc.returncode} before {ready_url} was ready:\n{log_tail(log_path)}")
            if time.monotonic() - started > ready_timeout_s:
                pytest.fail(f"{ready_url} not 200 after {ready_timeout_s} s:\n{log_tail(log_path)}")
            time.sleep(1)
        print(f"server ready in {time.monotonic() - started:.1f} s")
        yield proc
    finally:
        _stop(proc, sigterm_whole_group)


def resend_until_cached(send: Callable[[], dict[str, Any]], attempts: int = 5) -> tuple[dict[str, Any], int]:
    """Send the same completion again until part of its prompt comes from a cache: (reply, cached tokens).

    The store of the first request may land just after its answer, so the first repeat can still miss.
    """
    for attempt in range(attempts):
        reply = send()
        cached = int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        if cached or attempt == attempts - 1:
            return reply, cached
        time.sleep(0.5)
    raise ValueError("attempts must be positive")


@dataclass
class FrontServer:
    url: str
    log_path: Path

    def log_tail(self, num_chars: int = 4000) -> str:
        return log_tail(self.log_path, num_chars)


def post_json(url: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[dict[str, str], Any]:
    """POST a JSON body: (lower-cased reply headers, parsed JSON body, or the raw body when it is not JSON)."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=180) as response:
        body = response.read()
        reply_headers = {k.lower(): v for k, v in response.headers.items()}
        # Session requests answer plain text ("Session <id> created").
        is_json = reply_headers.get("content-type", "").startswith("application/json")
        return reply_headers, json.loads(body) if is_json else body


@contextmanager
def front_vllm_server(model: Path, root: Path, cache_config: dict[str, Any],
                      extra_env: dict[str, str] | None = None) -> Iterator[FrontServer]:
    """vLLM's OpenAI server on ``model`` with the connector (``cache_config`` as its LMCache YAML), the LMI
    front door as middleware and AWS's session library on; vLLM's own prefix cache off. Files go to ``root``."""
    for sub in ("rpc", "vllm-cache", "sessions"):
        (root / sub).mkdir(parents=True)
    config = root / "lmi-cache.yaml"
    config.write_text(json.dumps(cache_config))
    port = free_port_block(1)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LMCACHE_", "SAGEMAKER_", "OPTION_", "PROMETHEUS_"))}
    env.update({
        "LMCACHE_CONFIG_FILE": str(config),
        "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_PATH": str(root / "sessions"),
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_RPC_BASE_PATH": str(root / "rpc"), "VLLM_CACHE_ROOT": vllm_cache_root(root),
        "HF_HUB_OFFLINE": "1", **LEAN_VLLM_ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        **(extra_env or {}),
    })
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--enforce-eager", "--seed", "0", "--no-enable-prefix-caching",
           "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(CONNECTOR),
           "--middleware", "lmi_cache.front.middleware.LmiFrontMiddleware"]
    log_path = root / "vllm.log"
    try:
        with running_server(cmd, env=env, log_path=log_path, ready_url=f"http://127.0.0.1:{port}/health",
                            sigterm_whole_group=True):
            yield FrontServer(f"http://127.0.0.1:{port}", log_path)
    finally:
        shutil.rmtree(root / "rpc", ignore_errors=True)
