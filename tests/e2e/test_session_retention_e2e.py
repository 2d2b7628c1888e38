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

import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_process import FrontServer, front_vllm_server, post_json

pytestmark = [pytest.mark.vllm]

CHUNK_TOKENS = 256
PROMPT_TOKENS = 5 * CHUNK_TOKENS  # 5 chunks of the 7M model: 2.5 MiB of float32 KV
CPU_TIER_GIB = 0.008  # ~8 MiB: about 15 chunks
FLOOD_PROMPTS = 6  # 30 chunks: twice the tier
SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"


def token_ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4096) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def server(tiny_model: Path, e2e_dir: Path) -> Iterator[FrontServer]:
    root = Path(tempfile.mkdtemp(prefix="session-retention-", dir=e2e_dir))
    config = {"chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": CPU_TIER_GIB,
              "max_local_disk_size": 0, "extra_config": {"session_retention_share": 0.5}}
    with front_vllm_server(tiny_model, root, config) as server:
        yield server


def cached_tokens(server: FrontServer, prompt: list[int], session_id: str | None = None) -> int:
    headers = {SESSION_HEADER: session_id} if session_id else {}
    _, reply = post_json(f"{server.url}/invocations", {"prompt": prompt, "max_tokens": 1, "temperature": 0}, headers)
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def flood(server: FrontServer, first_seed: int) -> None:
    for seed in range(first_seed, first_seed + FLOOD_PROMPTS):
        assert cached_tokens(server, token_ids(seed)) == 0  # all new: each stores 5 chunks, evicting others


def test_an_open_session_keeps_its_chunks_under_pressure_until_it_closes(server: FrontServer) -> None:
    headers, _ = post_json(f"{server.url}/invocations", {"requestType": "NEW_SESSION"})
    session_id = headers["x-amzn-sagemaker-session-id"].split(";")[0]
    conversation, control = token_ids(1), token_ids(2)
    assert cached_tokens(server, conversation, session_id) == 0
    assert cached_tokens(server, control) == 0
    flood(server, 100)
    # The hit is capped at prompt - 1 tokens, block (128) aligned: 1,152 of 1,280.
    assert cached_tokens(server, conversation, session_id) == PROMPT_TOKENS - 128, server.log_tail()
    assert cached_tokens(server, control) == 0  # no session: evicted by the flood like the rest

    headers, _ = post_json(f"{server.url}/invocations", {"requestType": "CLOSE"}, {SESSION_HEADER: session_id})
    assert headers["x-amzn-sagemaker-closed-session-id"] == session_id
    flood(server, 200)  # the scheduler sees the closed session and the workers release its chunks
    assert cached_tokens(server, conversation) == 0, "a closed session's chunks must be evictable again"
