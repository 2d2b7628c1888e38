"""What the LMI front door adds per request: in process, and end to end on vLLM CPU, side by side.

Runs as a script: ``python benchmarks/bench_front.py [--requests 300] [--skip-e2e]``.

1. In process (no vLLM): the front middleware around a stub ASGI app that
   answers with a canned vLLM completion (JSON and SSE), against the stub
   alone, interleaved: the front's own CPU time per request (translate the
   LMI request, rewrite the answer).
2. End to end: one vLLM OpenAI server on the tiny model, started with
   ``--middleware lmi_cache.front.middleware.LmiFrontMiddleware``; the same
   1-token greedy completion sent in rotating order over a kept-alive
   connection as an OpenAI payload to ``/v1/completions`` (the front checks
   its size and model name), as an OpenAI payload to ``/invocations`` (passed
   through) and as an LMI payload to ``/invocations`` (translated both ways).
   Prints medians, p90s, differences and ratios. (Two servers side by side,
   with and without the front, differ by more than the front costs on a
   shared 2-core machine: their workers compete for the same cores.)
3. On the same server, a 64 MiB body sent with a Content-Length and then
   chunked (no length): the time until the 413 arrives, and the slowest
   ``/ping`` answer while it was being sent (another thread pings every 10 ms).
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, MutableMapping
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lmi_cache.bench.stats import percentile  # noqa: E402

PROMPT = "def main():\n    print('hello world')\n"
CANNED = {"id": "c", "object": "text_completion", "model": "tiny", "choices": [
    {"index": 0, "text": " x", "finish_reason": "length", "stop_reason": None, "logprobs": None}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}
CANNED_SSE = (b'data: {"choices": [{"index": 0, "text": " x", "token_ids": [5], "finish_reason": "length", '
              b'"logprobs": {"tokens": [" x"], "token_logprobs": [-0.1]}}]}\n\ndata: [DONE]\n\n')


async def _stub(scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
                send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if b'"stream": true' in body:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": CANNED_SSE, "more_body": False})
        return
    data = json.dumps(CANNED).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _call(app: Any, body: bytes) -> float:
    scope = {"type": "http", "method": "POST", "path": "/invocations",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        return None

    start = time.perf_counter()
    await app(scope, receive, send)
    return time.perf_counter() - start


def in_process(iterations: int) -> list[tuple[str, float, float]]:
    from lmi_cache.front.middleware import LmiFrontMiddleware

    front = LmiFrontMiddleware(_stub, adapters={})
    cases = [
        ("LMI inputs, JSON answer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "do_sample": False}},
         {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}),
        ("LMI inputs, streamed", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 1}},
         {"prompt": PROMPT, "max_tokens": 1, "stream": True}),
        ("OpenAI prompt (pass-through)", {"prompt": PROMPT, "max_tokens": 1, "model": "tiny"},
         {"prompt": PROMPT, "max_tokens": 1, "model": "tiny"}),
    ]
    rows = []
    for name, lmi, openai in cases:
        lmi_body, openai_body = json.dumps(lmi).encode(), json.dumps(openai).encode()
        with_front, bare = [], []
        for _ in range(iterations):
            with_front.append(asyncio.run(_call(front, lmi_body)))
            bare.append(asyncio.run(_call(_stub, openai_body)))
        rows.append((name, percentile(with_front, 50), percentile(bare, 50)))
    return rows


class Client:
    """One kept-alive HTTP connection; ``post`` returns seconds until the whole answer was read."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=120)

    def post(self, path: str, payload: dict[str, Any]) -> tuple[float, bytes]:
        body = json.dumps(payload).encode()
        start = time.perf_counter()
        self.conn.request("POST", path, body, {"Content-Type": "application/json"})
        reply = self.conn.getresponse()
        data = reply.read()
        elapsed = time.perf_counter() - start
        if reply.status != 200:
            raise RuntimeError(f"POST {path} -> {reply.status}: {data[:300]!r}")
        return elapsed, data


def big_body(url: str, chunked: bool) -> tuple[int, float, float]:
    """(status, seconds until the answer, slowest /ping meanwhile) for a 64 MiB /invocations body."""
    parsed = urlparse(url)
    body = b'{"inputs": "' + b"a" * (64 << 20) + b'"}'
    pings: list[float] = []
    stop = threading.Event()

    def ping() -> None:
        conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=30)
        while not stop.is_set():
            start = time.perf_counter()
            conn.request("GET", "/ping")
            conn.getresponse().read()
            pings.append(time.perf_counter() - start)
            time.sleep(0.01)

    pinger = threading.Thread(target=ping)
    pinger.start()
    conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=60)
    start = time.perf_counter()
    payload: Any = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if chunked else body
    try:
        conn.request("POST", "/invocations", payload, {"Content-Type": "application/json"}, encode_chunked=chunked)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the whole body was sent
    reply = conn.getresponse()
    reply.read()
    elapsed = time.perf_counter() - start
    conn.close()
    time.sleep(0.1)
    stop.set()
    pinger.join()
    return reply.status, elapsed, max(pings, default=float("nan"))


def end_to_end(requests: int, work: Path) -> tuple[bool, dict[str, list[float]], list[tuple[str, int, float, float]]]:
    from lmi_cache.bench.vllm_server import ServerSpec, VllmServer
    from lmi_cache.devtools.tiny_model import make_tiny_model
    from lmi_cache.front.options import MIDDLEWARE

    model = make_tiny_model(work / "tiny-7m", "7m", seed=0)
    sessions = {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_PATH": str(work / "sessions")}
    spec = ServerSpec(model, max_model_len=2048, kvcache_space_gib=1, extra_env=sessions,
                      extra_args=["--middleware", MIDDLEWARE])
    lmi = {"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "do_sample": False}}
    openai = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        ROUTE_OPENAI: ("/v1/completions", openai), ROUTE_INVOKE_OPENAI: ("/invocations", openai),
        ROUTE_INVOKE_LMI: ("/invocations", lmi)}
    with VllmServer(spec, work / "front") as server:
        client = Client(server.url)
        _, lmi_answer = client.post("/invocations", lmi)
        _, openai_answer = client.post("/v1/completions", openai)
        same = json.loads(lmi_answer)["generated_text"] == json.loads(openai_answer)["choices"][0]["text"]
        for _ in range(20):  # warm-up
            for path, payload in cases.values():
                client.post(path, payload)
        times: dict[str, list[float]] = {name: [] for name in cases}
        names = list(cases)
        for i in range(requests):
            for name in names[i % 3:] + names[:i % 3]:  # rotate the order: no case always goes first
                path, payload = cases[name]
                times[name].append(client.post(path, payload)[0])
        refusals = [(how, *big_body(server.url, chunked)) for how, chunked in
                    (("with Content-Length", False), ("chunked, no length", True))]
    return same, times, refusals


ROUTE_OPENAI = "OpenAI prompt on /v1/completions (the front checks size and model name)"
ROUTE_INVOKE_OPENAI = "OpenAI prompt on /invocations (front passes it through)"
ROUTE_INVOKE_LMI = "LMI inputs on /invocations (front translates both ways)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="rounds of the three end-to-end requests")
    parser.add_argument("--iterations", type=int, default=3000, help="calls per in-process case")
    parser.add_argument("--skip-e2e", action="store_true", help="only the in-process measurement")
    args = parser.parse_args()
    print("## In process: front middleware + stub app vs stub app alone (median per request)\n")
    print("| case | with front | stub alone | added |")
    print("|---|---|---|---|")
    for name, front_s, bare_s in in_process(args.iterations):
        print(f"| {name} | {front_s * 1e6:.0f} us | {bare_s * 1e6:.0f} us | {(front_s - bare_s) * 1e6:+.0f} us |")
    if args.skip_e2e:
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-front-") as tmp:
        same, times, refusals = end_to_end(args.requests, Path(tmp))
    print(f"\n## End to end: 1-token greedy completion, one vLLM CPU server with the front, "
          f"{args.requests} rounds (same token from LMI and OpenAI payloads: {same})\n")
    base = percentile(times[ROUTE_OPENAI], 50)
    print("| request | p50 | p90 | p50 vs /v1/completions |")
    print("|---|---|---|---|")
    for name, values in times.items():
        p50 = percentile(values, 50)
        print(f"| {name} | {p50 * 1e3:.2f} ms | {percentile(values, 90) * 1e3:.2f} ms | "
              f"{(p50 - base) * 1e3:+.2f} ms ({p50 / base:.3f}x) |")
    lmi, plain = percentile(times[ROUTE_INVOKE_LMI], 50), percentile(times[ROUTE_INVOKE_OPENAI], 50)
    print(f"\nLMI translation end to end (LMI vs OpenAI payload on /invocations): {(lmi - plain) * 1e3:+.2f} ms "
          f"at the median ({lmi / plain:.3f}x)")
    print("\n## A 64 MiB body on /invocations\n")
    print("| sent | status | answered after | slowest /ping meanwhile |")
    print("|---|---|---|---|")
    for how, status, elapsed, slowest in refusals:
        print(f"| {how} | {status} | {elapsed * 1e3:.1f} ms | {slowest * 1e3:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
