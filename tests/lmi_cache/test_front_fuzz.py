"""Hypothesis-driven HTTP fuzzing of the real front middleware in process (ASGI, stub engine, no vLLM).

Bodies (nesting, sizes, encodings, NaN/Infinity, LMI and OpenAI shapes) and
headers (session and adapter ids with traversal, control bytes and header
injection) on ``/invocations``, the OpenAI routes and the runtime adapter
routes: every answer is 2xx or 4xx, nothing escapes the middleware, and the
log holds no traceback. Each property is bounded to a few seconds.
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmi_cache.front.adapter_routes import AdapterRoutes
from lmi_cache.front.adapters import Adapter
from lmi_cache.front.middleware import LmiFrontMiddleware
from tests.lmi_cache.test_front_middleware import COMPLETION, FakeSessions, Message, StubApp

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
KEYS = ["inputs", "parameters", "prompt", "messages", "model", "adapters", "stream", "requestType", "session_id",
        "max_new_tokens", "details", "n", "vllm_xargs", "do_sample", "role", "content"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
                    st.sampled_from(["NEW_SESSION", "CLOSE", "tenant", "../../etc", "", "中文"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)),
    max_leaves=30)
odd_ids = st.one_of(st.text(max_size=80), st.sampled_from([
    "../../etc/passwd", "NEW_SESSION", "", " ", "a\r\nX-Injected: 1", "tenant", "/etc", "%2e%2e%2f", "a" * 300,
    "abc; Expires=2030-01-01T00:00:00Z"]))


def deep(levels: int) -> bytes:
    return b'{"inputs": ' + b"[" * levels + b"]" * levels + b"}"


bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v, allow_nan=True).encode()),
    json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-16")),
    st.binary(max_size=200),
    st.integers(1, 3000).map(deep),
    st.integers(0, 20_000).map(lambda n: json.dumps({"inputs": "x" * n}).encode()),
)


class Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def log() -> Any:
    handler = Log()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


def app(tmp_path: Path) -> LmiFrontMiddleware:
    (tmp_path / "adapters" / "good").mkdir(parents=True, exist_ok=True)
    (tmp_path / "adapters" / "good" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (tmp_path / "adapters" / "good" / "adapter_model.bin").write_bytes(b"")
    adapters = {"tenant": Adapter("tenant", tmp_path / "adapters" / "good", rank=4),
                "broken": Adapter("broken", tmp_path / "nowhere", error="no adapter_config.json")}
    routes = AdapterRoutes(adapters, enabled=True, roots=[tmp_path / "adapters"], max_runtime=3)
    return LmiFrontMiddleware(StubApp(body=COMPLETION), adapters=adapters, sessions=FakeSessions(), routes=routes,
                              max_body=64 << 10, base_names=frozenset({"base"}))


def call(front: LmiFrontMiddleware, method: str, path: str, body: bytes,
         headers: list[tuple[bytes, bytes]]) -> int:
    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "headers": headers}
    out: list[Message] = []
    chunks = [body[:7], body[7:]]

    async def receive() -> Message:
        if chunks:
            part = chunks.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        out.append(message)

    asyncio.run(front(scope, receive, send))
    return int(out[0]["status"])


def assert_clean(status: int, log: Log) -> None:
    assert 200 <= status < 300 or 400 <= status < 500, status
    assert all(r.exc_info is None and r.levelno < logging.ERROR for r in log.records), \
        [r.getMessage() for r in log.records]
    assert not any("Traceback" in r.getMessage() for r in log.records)
    log.records.clear()


def header_list(session: str | None, adapter: str | None, extra: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    headers = [(k.lower().encode("latin-1", "replace"), v.encode("utf-8", "replace")) for k, v in extra]
    if session is not None:
        headers.append((b"x-amzn-sagemaker-session-id", session.encode("utf-8", "replace")))
    if adapter is not None:
        headers.append((b"x-amzn-sagemaker-adapter-identifier", adapter.encode("utf-8", "replace")))
    return headers


@FUZZ
@given(body=bodies, session=st.none() | odd_ids, adapter=st.none() | odd_ids,
       extra=st.lists(st.tuples(st.sampled_from(["x-session-id", "content-length", "content-type", "x-a"]),
                                st.text(max_size=20)), max_size=3))
def test_invocations_answer_only_2xx_or_4xx(tmp_path_factory: Any, log: Log, body: bytes, session: str | None,
                                            adapter: str | None, extra: list[tuple[str, str]]) -> None:
    front = app(tmp_path_factory.mktemp("fz"))
    assert_clean(call(front, "POST", "/invocations", body, header_list(session, adapter, extra)), log)


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_openai_routes_answer_only_2xx_or_4xx(tmp_path_factory: Any, log: Log, path: str, body: bytes) -> None:
    assert_clean(call(app(tmp_path_factory.mktemp("fz")), "POST", path, body, []), log)


@FUZZ
@given(name=odd_ids, src=odd_ids | st.sampled_from(["good", "../good", "good/../../x", "/proc/self"]),
       route=st.sampled_from(["/adapters", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/adapters/"]))
def test_adapter_routes_answer_only_2xx_or_4xx(tmp_path_factory: Any, log: Log, name: str, src: str,
                                               route: str) -> None:
    front = app(tmp_path_factory.mktemp("fz"))
    if route == "/adapters/":
        status = call(front, "DELETE", route + name, b"", [])
    else:
        payload = {"name": name, "src": src, "lora_name": name, "lora_path": src}
        status = call(front, "POST", route, json.dumps(payload).encode(), [])
    assert_clean(status, log)
    for runtime_path in front.routes.runtime.values():  # whatever got registered lies inside the root
        assert runtime_path.resolve().is_relative_to(front.routes.roots[0].resolve())
