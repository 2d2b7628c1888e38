"""Two ``lmi-cache serve`` instances share KV peer to peer: B loads what A computed, from A's CPU tier.

One module fixture starts both servers (separate CPU tiers, no Redis, the peer
tier on through ``option.lmcache_enable_p2p`` and its ports, auto-configured)
and every scenario runs against them:

- a long document sent to A, then to B with the router's hint naming A: B
  loads it from A (``lmi_cache_loaded_tokens_total{tier="peer"}`` on B's
  /metrics) and answers exactly as A did computing it (float32, greedy, the
  same logprobs); B's time for it and for a cold document of the same
  length are printed side by side;
- A serving corrupted bytes (its test hook, a flag file): B answers exactly,
  the damaged chunks counted as corrupted peer reads;
- A killed while B's hinted request is on its way: B still answers exactly,
  within the bounded wait.
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
from e2e_support import job_slot
from test_serve_e2e import Server, free_port, metric_values, post, running_serve, serve_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "serving.properties.d" / "cpu-tiny-demo" / "serving.properties"
TIMEOUT_MS = 2000  # B's peer_timeout_ms (the default)


def document(name: str) -> str:
    """About 2,500 tokens (many 256-token chunks), different for every name."""
    return " ".join(f"{name}{i} alpha beta gamma" for i in range(250))


def start(stack: ExitStack, tiny_model: Path, root: Path, corrupt_flag: Path | None = None) -> tuple[Server, int]:
    root.mkdir()
    model_dir = root / "model"
    model_dir.mkdir()
    port, p2p, lookup = free_port(), free_port(), free_port()
    lines = [f"option.model_id={tiny_model}" if line.startswith("option.model_id=") else line
             for line in EXAMPLE.read_text().splitlines()]
    lines += ["option.lmcache_enable_p2p=true", "option.lmcache_p2p_host=127.0.0.1",
              f"option.lmcache_p2p_init_ports={p2p}", f"option.lmcache_p2p_lookup_ports={lookup}"]
    (model_dir / "serving.properties").write_text("\n".join(lines) + "\n")
    extra: dict[str, str] = {}
    if corrupt_flag is not None:
        extra["LMI_CACHE_TEST_PEER_CORRUPT"] = str(corrupt_flag)
    server = stack.enter_context(running_serve(model_dir, root, serve_env(root, port, extra), port))
    return server, p2p


@pytest.fixture(scope="module")
def pair(tiny_model: Path, e2e_dir: Path) -> Iterator[dict[str, Any]]:
    flag = e2e_dir / "peer-corrupt-flag"
    with job_slot(whole_machine=True), ExitStack() as stack:
        servers: dict[str, Any] = {}
        threads = [threading.Thread(target=lambda n=name: servers.__setitem__(n, start(
            stack, tiny_model, e2e_dir / f"peer-{n}", flag if n == "a" else None))) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert set(servers) == {"a", "b"}, "a server did not start (see its serve.log)"
        (a, a_port), (b, _) = servers["a"], servers["b"]
        yield {"a": a, "b": b, "hint": {"remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": a_port}},
               "flag": flag}
        for name, server in (("A", a), ("B", b)):  # what the peer tiers said, in the -s output
            print(f"{name}:", "\n".join(line for line in server.log_path.read_text(errors="replace").splitlines()
                                         if "peer" in line.lower() and "lmi" in line.lower())[-3000:])


def complete(server: Server, prompt: str, hint: dict[str, Any] | None = None) -> tuple[dict[str, Any], float]:
    payload: dict[str, Any] = {"model": str(_model(server)), "prompt": prompt, "max_tokens": 8, "temperature": 0,
                               "logprobs": 1}
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


def assert_same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same text, token by token, and the same logprobs up to float32 rounding: a hit computes only the
    prompt's tail, so vLLM CPU's matmuls run in other shapes than a full prefill and round differently (~1e-6)."""
    got_choice, want_choice = got["choices"][0], want["choices"][0]
    assert got_choice["text"] == want_choice["text"]
    assert got_choice["logprobs"]["tokens"] == want_choice["logprobs"]["tokens"]
    assert got_choice["logprobs"]["token_logprobs"] == pytest.approx(want_choice["logprobs"]["token_logprobs"],
                                                                     abs=1e-4)


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


def test_b_loads_a_document_from_a_and_answers_exactly(pair: dict[str, Any]) -> None:
    a, b = pair["a"], pair["b"]
    on_a, _ = complete(a, document("shared"))
    assert on_a["usage"]["prompt_tokens"] > 2000
    _, cold_s = complete(b, document("cold"))  # a cold prefill of the same length, for comparison
    before = peer_series(b, "lmi_cache_loaded_tokens_total")
    on_b, peer_s = complete(b, document("shared"), pair["hint"])
    loaded = peer_series(b, "lmi_cache_loaded_tokens_total") - before
    cached = on_b["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"B: cold prefill {cold_s * 1000:.0f} ms, from peer A {peer_s * 1000:.0f} ms ({cached} tokens from A)")
    assert loaded >= 2048 and cached >= 2048, (peer_metrics(b), cache_lines(a) + cache_lines(b))
    assert_same_answer(on_b, on_a)
    assert peer_series(b, "lmi_cache_tier_hit_tokens_total") >= loaded


def test_corrupted_bytes_from_a_are_misses_on_b(pair: dict[str, Any]) -> None:
    a, b = pair["a"], pair["b"]
    on_a, _ = complete(a, document("damaged"))
    pair["flag"].write_text("on")
    try:
        before = peer_series(b, "lmi_cache_corrupted_reads_total")
        on_b, _ = complete(b, document("damaged"), pair["hint"])
    finally:
        pair["flag"].unlink()
    assert peer_series(b, "lmi_cache_corrupted_reads_total") > before, (peer_metrics(b), cache_lines(b),
                                                                       peer_lines(a))
    assert_same_answer(on_b, on_a)


def test_a_killed_mid_request_costs_b_a_bounded_wait(pair: dict[str, Any]) -> None:
    a, b = pair["a"], pair["b"]
    on_a, _ = complete(a, document("orphan"))
    result: dict[str, Any] = {}
    request = threading.Thread(target=lambda: result.update(zip(("reply", "seconds"), complete(
        b, document("orphan"), pair["hint"]))))
    request.start()
    os.killpg(a.proc.pid, signal.SIGKILL)  # the whole server: its engine and worker with the peer server
    request.join(timeout=120)
    assert not request.is_alive(), f"B hangs on a dead peer:\n{b.log_tail()}"
    assert_same_answer(result["reply"], on_a)
    # The bound, plus a cold prefill on a busy host.
    assert result["seconds"] < TIMEOUT_MS / 1000 + 50, f"B took {result['seconds']:.0f} s"
