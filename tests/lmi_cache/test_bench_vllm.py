"""``lmi-cache bench`` against a real vLLM CPU server (tiny model, prefix caching on).

Slow (one server start): checks what the fake server cannot, that documents
are sized with vLLM's own ``/tokenize`` and that a repeated document is
found in vLLM's prefix cache the second time.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from vllm_cache import LEAN_VLLM_ENV, vllm_cache_root

from lmi_cache.bench.cli import bench
from lmi_cache.bench.paired import scrape_total
from lmi_cache.bench.vllm_server import ServerSpec, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_long_doc_qa_on_vllm(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from lmi_cache.devtools.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", size="7m")
    spec = ServerSpec(model_dir=model_dir, prefix_caching=True, max_model_len=2048,
                      extra_env=dict(LEAN_VLLM_ENV))
    out = tmp_path / "bench.json"
    vllm_cache_root(tmp_path / "run")  # the folder the server uses as VLLM_CACHE_ROOT: model info shared
    with VllmServer(spec, tmp_path / "run") as server:
        run = CliRunner().invoke(
            bench,
            ["--url", server.url, "--num-documents", "2", "--document-tokens", "1024", "--output-tokens", "4",
             "--concurrency", "1", "--ignore-eos", "--json", str(out)],
        )
        hit_tokens = scrape_total(server.url, "vllm:prefix_cache_hits")
    assert run.exit_code == 0, run.output
    data = json.loads(out.read_text())
    assert data["settings"]["model"] == "tiny"
    assert data["settings"]["token_count_source"] == "server"
    for num_tokens in data["settings"]["measured_document_tokens"]:
        assert 1024 - 3 <= num_tokens <= 1024
    for request in data["requests"]:
        assert request["completion_tokens"] == 4
        assert 1024 < request["prompt_tokens"] < 1024 + 64
    warmup, query = data["rounds"]
    assert warmup["ttft_s"]["mean"] > 0 and query["ttft_s"]["mean"] > 0
    # 1024 tokens are 8 full blocks: the query round finds both documents' blocks in vLLM's prefix cache
    # (the server's own count, not a timing: the suite shares its cores with other work).
    assert hit_tokens >= 2 * 1024 - 2 * 128
