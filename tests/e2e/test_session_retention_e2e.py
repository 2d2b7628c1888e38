"""Session retention through real vLLM: an open session's chunks survive cache pressure, a closed one's do not.

One vLLM OpenAI server (started directly, with the LMI front door as its
middleware and AWS's session library on) with a CPU tier of a few dozen
chunks, half of it for open sessions, and vLLM's own prefix cache off. A
prompt sent in an open session and a control prompt sent without one are
followed by a flood of other prompts larger than the whole tier: the
session's prompt still hits, the control misses. Once the session is closed
its chunks are ordinary again: another flood evicts them. This also checks
the path the feature rests on: the front door forwards the session id as
``X-Session-ID`` and vLLM hands it to the scheduler as ``request.session_id``.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from server_process import running_server
from tests.local_ports import free_port_block

pytestmark = [pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
CHUNK_TOKENS = 256
PROMPT_TOKENS = 5 * CHUNK_TOKENS  # 5 chunks of the 7M model: 2.5 MiB of float32 KV
CPU_TIER_GIB = 0.008  # ~8 MiB: about 15 chunks
FLOOD_PROMPTS = 6  # 30 chunks: twice the tier
CONNECTOR = {"kv_connector": "LmiCacheConnector", "kv_connector_module_path": "lmi_cache.vllm_connector",
             "kv_role": "kv_both"}
SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"


@dataclass
class Server:
    url: str
    log_path: Path

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def post(url: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[dict[str, str], Any]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=180) as response:
        body = response.read()
        headers = {k.lower(): v for k, v in response.headers.items()}
        # Session requests answer plain text ("Session <id> created").
        return headers, json.loads(body) if headers.get("content-type", "").startswith("application/json") else body


def token_ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4096) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def server(tiny_model: Path, e2e_dir: Path) -> Iterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="session-retention-", dir=e2e_dir))
    for sub in ("rpc", "vllm-cache", "sessions"):
        (root / sub).mkdir()
    config = root / "lmi-cache.yaml"
    config.write_text(json.dumps({"chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": CPU_TIER_GIB,
                                  "max_local_disk_size": 0, "extra_config": {"session_retention_share": 0.5}}))
    port = free_port_block(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "SAGEMAKER_", "OPTION_"))}
    env.update({
        "LMCACHE_CONFIG_FILE": str(config),
        "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_PATH": str(root / "sessions"),
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_RPC_BASE_PATH": str(root / "rpc"), "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--enforce-eager", "--no-enable-prefix-caching",
           "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(CONNECTOR),
           "--middleware", "lmi_cache.front.middleware.LmiFrontMiddleware"]
    log_path = root / "vllm.log"
    try:
        with running_server(cmd, env=env, log_path=log_path, ready_url=f"http://127.0.0.1:{port}/health",
                            sigterm_whole_group=True):
            yield Server(f"http://127.0.0.1:{port}", log_path)
    finally:
        shutil.rmtree(root / "rpc", ignore_errors=True)


def cached_tokens(server: Server, prompt: list[int], session_id: str | None = None) -> int:
    headers = {SESSION_HEADER: session_id} if session_id else {}
    _, reply = post(f"{server.url}/invocations", {"prompt": prompt, "max_tokens": 1, "temperature": 0}, headers)
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def flood(server: Server, first_seed: int) -> None:
    for seed in range(first_seed, first_seed + FLOOD_PROMPTS):
        assert cached_tokens(server, token_ids(seed)) == 0  # all new: each stores 5 chunks, evicting others


def test_an_open_session_keeps_its_chunks_under_pressure_until_it_closes(server: Server) -> None:
    headers, _ = post(f"{server.url}/invocations", {"requestType": "NEW_SESSION"})
    session_id = headers["x-amzn-sagemaker-session-id"].split(";")[0]
    conversation, control = token_ids(1), token_ids(2)
    assert cached_tokens(server, conversation, session_id) == 0
    assert cached_tokens(server, control) == 0
    flood(server, 100)
    # The hit is capped at prompt - 1 tokens, block (128) aligned: 1,152 of 1,280.
    assert cached_tokens(server, conversation, session_id) == PROMPT_TOKENS - 128, server.log_tail()
    assert cached_tokens(server, control) == 0  # no session: evicted by the flood like the rest

    headers, _ = post(f"{server.url}/invocations", {"requestType": "CLOSE"}, {SESSION_HEADER: session_id})
    assert headers["x-amzn-sagemaker-closed-session-id"] == session_id
    flood(server, 200)  # the scheduler sees the closed session and the workers release its chunks
    assert cached_tokens(server, conversation) == 0, "a closed session's chunks must be evictable again"
