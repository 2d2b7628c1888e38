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

import urllib.request
from collections.abc import Iterator
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
    window_groups,
)
from server_process import FrontServer, front_vllm_server, post_json
from shared_jobs import GEMMA2_REFERENCE, SharedJobs

pytestmark = [pytest.mark.vllm]

SHAPE = "gemma2-7m"
MAX_TOKENS = 8
# 1,100 tokens, then +180 and +200: each turn's hit (1,024 then 1,280 tokens) is chunk and block aligned,
# so vLLM's own prefix cache splits the reference at the same token and the greedy tokens compare exactly.
TURNS = [random_tokens(500, 1100)]
TURNS += [TURNS[0] + random_tokens(501, 180)]
TURNS += [TURNS[1] + random_tokens(502, 200)]
SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"


def loaded_tokens(server: FrontServer) -> float:
    """lmi_cache_loaded_tokens_total of the CPU tier, summed over the label sets, from vLLM's /metrics."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lmi_cache_loaded_tokens_total{") and 'tier="cpu"' in line)


# The turns through vLLM without a connector, its own prefix cache on (the warm turns' exact split):
# phases of the shared Gemma-2 reference job (shared_jobs.py).
GEMMA2_REFERENCE.add(__name__, [gen_phase(f"turn{i}", prompts([t])) for i, t in enumerate(TURNS)])


@pytest.fixture(scope="module")
def reference(shared_jobs: SharedJobs) -> dict[str, Any]:
    return shared_jobs.result(GEMMA2_REFERENCE, __name__)


@pytest.fixture(scope="module")
def server(gemma2_model: Path, e2e_dir: Path) -> Iterator[FrontServer]:
    root = e2e_dir / f"session-{SHAPE}-server"
    (root / "prometheus").mkdir(parents=True)  # vLLM's /metrics then gathers the engine process's lmi_cache_* series
    config = {"chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": 0.5,
              "max_local_disk_size": 0, "extra_config": {"session_retention_share": 0.5}}
    with front_vllm_server(gemma2_model, root, config, {"PROMETHEUS_MULTIPROC_DIR": str(root / "prometheus")}) as server:
        yield server


def test_session_turns_reuse_the_cache_and_match_no_connector(server: FrontServer, reference: dict[str, Any]) -> None:
    headers, _ = post_json(f"{server.url}/invocations", {"requestType": "NEW_SESSION"})
    session = {SESSION_HEADER: headers["x-amzn-sagemaker-session-id"].split(";")[0]}
    groups = window_groups(SHAPE)
    shared = 0  # tokens of the conversation that an earlier turn stored
    for i, turn in enumerate(TURNS):
        before = loaded_tokens(server)
        _, reply = post_json(f"{server.url}/invocations", {"prompt": turn, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "return_token_ids": True}, session)
        hit = expected_hit_tokens(len(turn), shared) if shared else 0
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == hit, f"turn {i}"
        assert reply["choices"][0]["token_ids"] == phase(reference, f"turn{i}")["outputs"][0]["tokens"], f"turn {i}"
        # The windowed group reads only its last window's chunks, the full group every chunk of the hit.
        assert loaded_tokens(server) - before == chunks_loaded_per_hit(groups, hit) * CHUNK_TOKENS, f"turn {i}"
        shared = len(turn)
    assert [expected_hit_tokens(len(TURNS[i]), len(TURNS[i - 1])) for i in (1, 2)] == [1024, 1280]
    headers, _ = post_json(f"{server.url}/invocations", {"requestType": "CLOSE"}, session)
    assert headers["x-amzn-sagemaker-closed-session-id"] == session[SESSION_HEADER]
    assert HMA_OFF_LINE not in server.log_path.read_text(errors="replace")
