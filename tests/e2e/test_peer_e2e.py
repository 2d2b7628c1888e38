"""Two ``lmi-cache serve`` instances share KV peer to peer: B loads what A computed, from A's CPU tier.

One module fixture starts both servers (separate CPU tiers, the peer tier on
through ``option.lmcache_enable_p2p`` and its ports, auto-configured, and a
Redis the test starts as both servers' ``option.lmcache_peer_holders_url``:
holder records only, no remote tier, so no KV is copied anywhere) and every
scenario runs against them. Every answer is compared with vLLM without a connector
(float32, greedy: the shared reference job, ``TINY_REFERENCE``):

- a long document sent to A, then to B with the router's hint naming A: B
  loads it from A (``lmi_cache_loaded_tokens_total{tier="peer"}`` on B's
  /metrics); B's time for it and for a cold document of the same length are
  printed side by side;
- a document sent to A, then to B with no hint: B finds A in the holder
  records A keeps in the Redis and loads it from A's CPU tier;
- A serving corrupted bytes (its test hook, a flag file): B answers exactly,
  the damaged chunks counted as corrupted peer reads;
- A killed while B's hinted request is on its way: B still answers exactly,
  within the bounded wait;
- after all of them, the Redis holds holder records and no KV chunk.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from e2e_support import gen_phase, job_slot, prompts, random_tokens
from shared_jobs import TINY_REFERENCE, SharedJobs
from test_serve_e2e import Server, free_port, metric_values, post, running_serve, serve_env

from lmi_cache.devtools.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "serving.properties.d" / "cpu-tiny-demo" / "serving.properties"
TIMEOUT_MS = 2000  # B's peer_timeout_ms (the default)
# Long documents as token ids (about 2,600 tokens: ten 256-token chunks), one per scenario; the reference job
# (vLLM without a connector, float32) answers each cold ("cold" only times a cold prefill).
DOCUMENTS = {name: random_tokens(700 + i, 2600) for i, name in enumerate(("shared", "cold", "found", "damaged",
                                                                         "orphan"))}
TINY_REFERENCE.add(__name__, [gen_phase(name, prompts([tokens])) for name, tokens in DOCUMENTS.items()
                              if name != "cold"])


def start(stack: ExitStack, tiny_model: Path, root: Path, redis_url: str,
          corrupt_flag: Path | None = None) -> tuple[Server, int]:
    root.mkdir()
    model_dir = root / "model"
    model_dir.mkdir()
    port, p2p, lookup = free_port(), free_port(), free_port()
    lines = [f"option.model_id={tiny_model}" if line.startswith("option.model_id=") else line
             for line in EXAMPLE.read_text().splitlines()]
    lines += ["option.lmcache_enable_p2p=true", "option.lmcache_p2p_host=127.0.0.1",
              f"option.lmcache_p2p_init_ports={p2p}", f"option.lmcache_p2p_lookup_ports={lookup}",
              f"option.lmcache_peer_holders_url={redis_url}"]
    (model_dir / "serving.properties").write_text("\n".join(lines) + "\n")
    # The holder records are read within lookup_timeout_ms (50 ms by default, which a loaded two-core CI machine
    # can miss: then the chunks are misses, as they should be). These tests are about finding the holder.
    extra: dict[str, str] = {"LMCACHE_LOOKUP_TIMEOUT_MS": "2000"}
    if corrupt_flag is not None:
        extra["LMI_CACHE_TEST_PEER_CORRUPT"] = str(corrupt_flag)
    server = stack.enter_context(running_serve(model_dir, root, serve_env(root, port, extra), port))
    return server, p2p


@pytest.fixture(scope="module")
def reference(shared_jobs: SharedJobs) -> dict[str, dict[str, Any]]:
    """vLLM without a connector: each document's output (token ids and logprobs) by name."""
    return {p["name"]: p["outputs"][0] for p in shared_jobs.result(TINY_REFERENCE, __name__)["phases"]}


@pytest.fixture(scope="module")
def pair(tiny_model: Path, e2e_dir: Path, reference: dict[str, dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Both servers, started after ``reference``: they hold every job slot, so a shared job that had not
    run yet would wait for them for ever (a run of this module alone did)."""
    flag = e2e_dir / "peer-corrupt-flag"
    with job_slot(whole_machine=True), ExitStack() as stack:
        redis = stack.enter_context(RedisServer())
        servers: dict[str, Any] = {}
        threads = [threading.Thread(target=lambda n=name: servers.__setitem__(n, start(
            stack, tiny_model, e2e_dir / f"peer-{n}", redis.url, flag if n == "a" else None))) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert set(servers) == {"a", "b"}, "a server did not start (see its serve.log)"
        (a, a_port), (b, _) = servers["a"], servers["b"]
        yield {"a": a, "b": b, "hint": {"remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": a_port}},
               "flag": flag, "redis": redis}
        for name, server in (("A", a), ("B", b)):  # what the peer tiers said, in the -s output
            print(f"{name}:", "\n".join(line for line in server.log_path.read_text(errors="replace").splitlines()
                                         if "peer" in line.lower() and "lmi" in line.lower())[-3000:])


def complete(server: Server, name: str, hint: dict[str, Any] | None = None) -> tuple[dict[str, Any], float]:
    """Document ``name`` as token ids, greedy, with the generated tokens' ids and logprobs."""
    payload: dict[str, Any] = {"model": str(_model(server)), "prompt": DOCUMENTS[name], "max_tokens": 8,
                               "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
    if hint is not None:
        payload["kv_transfer_params"] = hint
    started = time.perf_counter()
    reply = post(f"{server.url}/v1/completions", payload)
    return reply, time.perf_counter() - started


def _model(server: Server) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as response:
        return str(json.load(response)["data"][0]["id"])


def assert_reference_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The reference's tokens, and its logprobs up to float32 rounding: a hit computes only the prompt's tail,
    so vLLM CPU's matmuls run in other shapes than a full prefill and round differently (~1e-6)."""
    logprobs = got["choices"][0]["logprobs"]
    tokens = [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]]
    assert tokens == want["tokens"]
    chosen = [dict((tid, lp) for tid, lp in step)[tid] for step, tid in zip(want["logprobs"], want["tokens"])]
    assert logprobs["token_logprobs"] == pytest.approx(chosen, abs=1e-4)


def holder_records(pair: dict[str, Any]) -> int:
    """How many chunks the servers' holder records name in the Redis."""
    import redis

    return len(redis.Redis.from_url(pair["redis"].url).keys("*:peer:v1:*"))


def stored_keys(pair: dict[str, Any]) -> list[bytes]:
    import redis

    return list(redis.Redis.from_url(pair["redis"].url).keys("*"))


def peer_series(server: Server, name: str) -> float:
    return sum(v for k, v in metric_values(server.url, name).items() if 'tier="peer"' in k)


def peer_metrics(server: Server) -> dict[str, float]:
    return {k: v for k, v in metric_values(server.url, "lmi_cache_").items() if "peer" in k}


def peer_lines(server: Server) -> str:
    """The server's log from its first peer-tier line on (tracebacks included), for failure messages."""
    text = server.log_path.read_text(errors="replace")
    start = text.find("lmi_cache.peer")
    return text[start:][-8000:] if start >= 0 else text[-3000:]


def cache_lines(server: Server) -> str:
    """The server's lmi-cache lines (what its peer tier said), for failure messages."""
    text = server.log_path.read_text(errors="replace")
    return "\n".join(line for line in text.splitlines() if "lmi-cache" in line or "lmi_cache" in line)[-6000:]


def complete_on_a(pair: dict[str, Any], name: str) -> dict[str, Any]:
    """The document on A, then wait until A advertises its ten chunks: A stores after it answers, so a request to
    B right away could find no holder (a miss, as it should be, but not what these tests are about)."""
    records = holder_records(pair)
    reply, _ = complete(pair["a"], name)
    deadline = time.monotonic() + 30
    while holder_records(pair) < records + 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    return reply


def test_b_loads_a_document_from_a_and_answers_exactly(pair: dict[str, Any], reference: dict[str, Any]) -> None:
    a, b = pair["a"], pair["b"]
    on_a = complete_on_a(pair, "shared")
    assert on_a["usage"]["prompt_tokens"] > 2000
    _, cold_s = complete(b, "cold")  # a cold prefill of the same length, for comparison
    before = peer_series(b, "lmi_cache_loaded_tokens_total")
    on_b, peer_s = complete(b, "shared", pair["hint"])
    loaded = peer_series(b, "lmi_cache_loaded_tokens_total") - before
    cached = on_b["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"B: cold prefill {cold_s * 1000:.0f} ms, from peer A {peer_s * 1000:.0f} ms ({cached} tokens from A)")
    assert loaded >= 2048 and cached >= 2048, (peer_metrics(b), cache_lines(a) + cache_lines(b))
    assert_reference_answer(on_a, reference["shared"])
    assert_reference_answer(on_b, reference["shared"])
    assert peer_series(b, "lmi_cache_tier_hit_tokens_total") >= loaded


def test_b_finds_a_through_the_holder_records_without_a_hint(pair: dict[str, Any], reference: dict[str, Any]) -> None:
    b = pair["b"]
    complete_on_a(pair, "found")
    before = peer_series(b, "lmi_cache_loaded_tokens_total")
    on_b, _ = complete(b, "found")  # no hint
    loaded = peer_series(b, "lmi_cache_loaded_tokens_total") - before
    assert loaded >= 2048, (holder_records(pair), peer_metrics(b), cache_lines(b))
    assert_reference_answer(on_b, reference["found"])


def test_corrupted_bytes_from_a_are_misses_on_b(pair: dict[str, Any], reference: dict[str, Any]) -> None:
    a, b = pair["a"], pair["b"]
    complete_on_a(pair, "damaged")
    pair["flag"].write_text("on")
    try:
        before = peer_series(b, "lmi_cache_corrupted_reads_total")
        on_b, _ = complete(b, "damaged", pair["hint"])
    finally:
        pair["flag"].unlink()
    assert peer_series(b, "lmi_cache_corrupted_reads_total") > before, (peer_metrics(b), cache_lines(b),
                                                                       peer_lines(a))
    assert_reference_answer(on_b, reference["damaged"])


def test_a_killed_mid_request_costs_b_a_bounded_wait(pair: dict[str, Any], reference: dict[str, Any]) -> None:
    a, b = pair["a"], pair["b"]
    complete(a, "orphan")
    result: dict[str, Any] = {}
    request = threading.Thread(target=lambda: result.update(zip(("reply", "seconds"), complete(
        b, "orphan", pair["hint"]))))
    request.start()
    os.killpg(a.proc.pid, signal.SIGKILL)  # the whole server: its engine and worker with the peer server
    request.join(timeout=120)
    assert not request.is_alive(), f"B hangs on a dead peer:\n{b.log_tail()}"
    assert_reference_answer(result["reply"], reference["orphan"])
    # The bound, plus a cold prefill on a busy host.
    assert result["seconds"] < TIMEOUT_MS / 1000 + 50, f"B took {result['seconds']:.0f} s"


def test_the_holder_store_got_records_and_no_kv(pair: dict[str, Any]) -> None:
    """Last, after every document went through the servers: only ``<prefix>:peer:v1:<digest>`` records."""
    complete(pair["b"], "cold")  # B holds (and advertises) at least this document, whichever tests ran before
    deadline = time.monotonic() + 30
    while holder_records(pair) < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    keys = stored_keys(pair)
    assert holder_records(pair) >= 10 and all(b":peer:v1:" in key for key in keys), sorted(keys)[:5]
