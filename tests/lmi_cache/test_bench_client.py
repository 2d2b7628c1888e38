"""The bench client, runner and CLI against a fake OpenAI server on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lmi_cache.bench.cli import bench, run_bench
from lmi_cache.bench.client import BenchError, OpenAiClient, normalize_base_url
from lmi_cache.bench.fake_server import FakeOpenAiServer, FakeServerState
from lmi_cache.bench.runner import run_round
from lmi_cache.bench.workloads import PromptRequest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(server: FakeOpenAiServer, **overrides: object):  # type: ignore[no-untyped-def]
    options: dict[str, object] = dict(
        url=server.url, model=None, workload="long-doc-qa", num_documents=3, document_tokens=3000,
        query_tokens=8, output_tokens=5, concurrency=2, num_users=2, num_rounds=3, seed=0,
        tokenizer=None, timeout_s=30.0, ignore_eos=False,
    )
    options.update(overrides)
    return asyncio.run(run_bench(**options))  # type: ignore[arg-type]


def test_long_doc_qa_measures_reuse() -> None:
    state = FakeServerState(prefill_s_per_token=0.00005, decode_s_per_token=0.002)
    with FakeOpenAiServer(state) as server:
        result = _run(server)
    warmup, query = result.round("warmup"), result.round("query")
    assert warmup is not None and query is not None
    assert warmup.num_requests == query.num_requests == 3
    # Documents fitted with the server's tokenizer (a word per token here).
    assert result.settings["measured_document_tokens"] == [3000, 3000, 3000]
    assert result.settings["token_count_source"] == "server"
    # The fake prefills 3000 tokens in 0.15 s cold and only the question when warm.
    assert warmup.ttft_s.min >= 0.15
    assert query.ttft_s.max < 0.5 * warmup.ttft_s.min
    ratios = result.ratios()
    assert ratios["ttft_mean"] is not None and ratios["ttft_mean"] < 0.5
    for item in result.rounds:
        for record in item.records:
            assert 0 < record.result.ttft_s < record.result.latency_s <= item.stats.round_latency_s
            assert record.result.completion_tokens == 5
            assert record.result.text.count(" w") == 5
    # Each document was sent once per round, warm-up first.
    assert len(state.prompts) == 6
    assert state.max_in_flight <= 2


def test_concurrency_limit_is_respected() -> None:
    state = FakeServerState(prefill_s_per_token=0.0, decode_s_per_token=0.03)
    requests = [PromptRequest(f"r{i}", f"prompt number {i}", 4) for i in range(9)]

    async def go(limit: int) -> None:
        async with OpenAiClient(server.url, "fake-model") as client:
            outcome = await run_round(client, "r", requests, limit)
        assert [r.request_id for r in outcome.records] == [r.request_id for r in requests]

    with FakeOpenAiServer(state) as server:
        asyncio.run(go(3))
        assert state.max_in_flight == 3
        state.max_in_flight = 0
        asyncio.run(go(1))
        assert state.max_in_flight == 1


def test_multi_round_chat_sends_growing_histories() -> None:
    state = FakeServerState(prefill_s_per_token=0.00002)
    with FakeOpenAiServer(state) as server:
        result = _run(server, workload="multi-round-chat", document_tokens=200)
    assert [item.stats.name for item in result.rounds] == ["round0", "round1", "round2"]
    assert len(state.prompts) == 2 * 3
    by_user = {0: [], 1: []}  # type: dict[int, list[str]]
    for prompt in state.prompts:
        by_user[0 if prompt.startswith("Context for user 0:") else 1].append(prompt)
    for prompts in by_user.values():
        prompts.sort(key=len)
        for earlier, later in zip(prompts, prompts[1:]):
            assert later.startswith(earlier + " w")  # previous answer follows the old prompt
    assert result.ratios()["ttft_mean"] is not None


def test_cli_writes_json_and_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with FakeOpenAiServer() as server:
        run = CliRunner().invoke(
            bench,
            ["--url", server.url + "/v1", "--model", "fake-model", "--num-documents", "2",
             "--document-tokens", "300", "--json", str(out)],
        )
    assert run.exit_code == 0, run.output
    assert "| warmup | 2 |" in run.output and "| query | 2 |" in run.output
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rounds"]] == ["warmup", "query"]
    assert len(data["requests"]) == 4
    assert data["settings"]["model"] == "fake-model"


def _cli_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmi_cache.bench", *args], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_connection_refused_is_one_line_exit_2() -> None:
    port = _free_port()
    run = _cli_subprocess("--url", f"http://127.0.0.1:{port}", "--model", "m", "--timeout", "10")
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--url" in lines[0]


@pytest.mark.parametrize("status", [500, 503])
def test_http_error_is_one_line_exit_2(status: int) -> None:
    with FakeOpenAiServer(FakeServerState(fail_status=status)) as server:
        run = CliRunner().invoke(bench, ["--url", server.url, "--num-documents", "1", "--document-tokens", "50"])
    assert run.exit_code == 2
    assert f"HTTP {status}" in run.output and "injected failure" in run.output
    assert "Traceback" not in run.output


def test_unknown_model_is_reported() -> None:
    async def go(url: str) -> None:
        async with OpenAiClient(url, "no-such-model") as client:
            await client.complete("hello", 2)

    with FakeOpenAiServer() as server:
        with pytest.raises(BenchError, match="HTTP 404.*no-such-model"):
            asyncio.run(go(server.url))


def test_normalize_base_url() -> None:
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("https://h") == "https://h"
    with pytest.raises(BenchError):
        normalize_base_url("h:8080")


def test_registering_the_command_does_not_import_aiohttp() -> None:
    code = "import sys, lmi_cache.bench.cli; print('aiohttp' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert run.stdout.strip() == "False"


def test_before_round_runs_before_each_rounds_requests() -> None:
    from lmi_cache.bench.runner import run_long_doc_qa
    from lmi_cache.bench.tokens import ServerTokenCounter
    from lmi_cache.bench.workloads import LongDocQaSpec

    state = FakeServerState()
    seen: list[tuple[str, int]] = []  # (round, prompts the server had received by then)

    async def go() -> None:
        async with OpenAiClient(server.url, "fake-model") as client:
            spec = LongDocQaSpec(num_documents=2, document_tokens=200, query_tokens=4, output_tokens=2, seed=1)
            await run_long_doc_qa(client, spec, ServerTokenCounter(client), 1, round_names=("warmup", "query", "rerun"),
                                  before_round=lambda name: seen.append((name, len(state.prompts))))

    with FakeOpenAiServer(state) as server:
        asyncio.run(go())
    assert seen == [("warmup", 0), ("query", 2), ("rerun", 4)]
    assert len(state.prompts) == 6
