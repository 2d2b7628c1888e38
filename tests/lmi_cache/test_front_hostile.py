"""The front middleware against careless and hostile requests (stub app, no vLLM): 4xx, bounded, nothing leaked."""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from lmi_cache.front.adapters import Adapter
from lmi_cache.front.formatters import Formatters
from lmi_cache.front.middleware import LmiFrontMiddleware
from tests.lmi_cache.test_front_middleware import COMPLETION, FakeSessions, Message, StubApp, run


def raw_call(app: Any, body: bytes, headers: dict[str, str] | None = None, path: str = "/invocations",
             chunk: int = 1 << 20, method: str = "POST") -> tuple[int, dict[bytes, bytes], bytes, int]:
    """Send ``body`` in chunks; returns status, headers, answer and how many chunks the app pulled."""
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    pulled = 0
    out: list[Message] = []

    async def receive() -> Message:
        nonlocal pulled
        if pulled < len(pieces):
            pulled += 1
            return {"type": "http.request", "body": pieces[pulled - 1], "more_body": pulled < len(pieces)}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        out.append(message)

    asyncio.run(app(scope, receive, send))
    return (int(out[0]["status"]), dict(out[0]["headers"]),
            b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body"), pulled)


def front(stub: StubApp | None = None, **kwargs: Any) -> LmiFrontMiddleware:
    kwargs.setdefault("adapters", {})
    kwargs.setdefault("sessions", FakeSessions())
    return LmiFrontMiddleware(stub or StubApp(body=COMPLETION), **kwargs)


def test_a_body_over_the_limit_is_413_before_it_is_read() -> None:
    stub = StubApp(body=COMPLETION)
    body = json.dumps({"inputs": "x" * 5000}).encode()
    status, _, answer, pulled = raw_call(front(stub, max_body=4096), body, {"Content-Length": str(len(body))})
    assert status == 413 and pulled == 0 and stub.calls == 0
    assert "option.max_request_bytes" in json.loads(answer)["error"]
    # Without a Content-Length (chunked), reading stops at the first chunk past the limit.
    status, _, _, pulled = raw_call(front(stub, max_body=4096), body, chunk=1024)
    assert status == 413 and pulled == 5 and stub.calls == 0
    # Other routes: a declared length past the limit is refused too.
    status, _, _, _ = raw_call(front(stub, max_body=4096), body, {"Content-Length": str(len(body))},
                               path="/tokenize")
    assert status == 413 and stub.calls == 0


def test_a_64_mib_body_is_refused_without_being_read() -> None:
    stub = StubApp(body=COMPLETION)
    body = b'{"inputs": "' + b"a" * (64 << 20) + b'"}'
    status, _, _, pulled = raw_call(front(stub, max_body=8 << 20), body, chunk=64 << 10)
    assert status == 413 and pulled == 129 and stub.calls == 0  # 8 MiB of 64 KiB chunks, and one more


@pytest.mark.parametrize("body, words", [
    (b"[" * 1000 + b"]" * 1000, "nested more than"),
    (b'{"inputs": ' + b"[" * 100 + b"]" * 100 + b"}", "nested more than"),
    (b'[{"inputs": "x"}]', "JSON object"),
    (b'"just a string"', "JSON object"),
    (b'{"inputs": "x", "parameters": {"temperature": NaN}}', "not valid JSON"),
    (b'{"inputs": "x", "parameters": {"top_p": Infinity}}', "not valid JSON"),
    (b'{"inputs": "\xff"}', "not valid JSON"),
    (b'{"requestType": "CLOSE"}', "CLOSE needs the session id"),
    (b'{"requestType": "NEW_SESSION", "extra": 1}', "nothing else"),
    (b'{"requestType": "DROP"}', "nothing else"),
])
def test_client_mistakes_are_a_400_with_one_line_and_no_traceback(body: bytes, words: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    stub = StubApp(body=COMPLETION)
    with caplog.at_level(logging.WARNING):
        status, _, answer, _ = raw_call(front(stub), body)
    assert status == 400 and stub.calls == 0
    reply = json.loads(answer)
    assert words in reply["error"] and reply["code"] == 400 and len(reply["request_id"]) == 16
    assert "Traceback" not in caplog.text and all(r.exc_info is None for r in caplog.records)
    assert [r.levelname for r in caplog.records] == ["WARNING"]


@pytest.mark.parametrize("value", ["", " ; Expires=2030-01-01T00:00:00Z", "../../etc",
                                   "a" * 200, "a b", "\u00e9t\u00e9"])
def test_an_empty_or_malformed_session_id_is_refused(value: str) -> None:
    stub = StubApp(body=COMPLETION)
    headers = {"X-Amzn-SageMaker-Session-Id": value}
    status, _, _, _ = raw_call(front(stub), b'{"inputs": "x"}', {k: v.encode().decode("latin-1")
                                                                  for k, v in headers.items()})
    assert status == 400 and stub.calls == 0


def test_vllm_gets_the_validated_session_id_whatever_the_client_sends() -> None:
    stub = StubApp(body=COMPLETION)
    payload = {"prompt": "Q", "session_id": "forged", "vllm_xargs": {"session_id": "forged2", "k": 1}}
    run(front(stub), payload, {"X-Session-ID": "forged3"})
    assert b"x-session-id" not in stub.seen_headers
    assert stub.seen_body == {"prompt": "Q", "vllm_xargs": {"k": 1}}
    run(front(stub), payload, {"X-Session-ID": "forged3", "X-Amzn-SageMaker-Session-Id": "abc"})
    assert stub.seen_headers[b"x-session-id"] == b"abc" and "session_id" not in stub.seen_body


def test_translation_reads_the_parsed_body_not_its_spelling() -> None:
    stub = StubApp(body=COMPLETION)
    escaped = b'{"\\u0069nputs": "Q", "parameters": {"max_new_tokens": 2}}'  # "inputs", escaped
    status, _, answer, _ = raw_call(front(stub), escaped)
    assert status == 200 and json.loads(answer) == {"generated_text": " hi"}
    assert stub.seen_body == {"prompt": "Q", "max_tokens": 2}
    utf16 = json.dumps({"inputs": "R"}).encode("utf-16")  # JSON allows UTF-16; vLLM gets UTF-8
    assert raw_call(front(stub), utf16)[0] == 200 and stub.seen_raw == b'{"prompt":"R","max_tokens":30}'


def test_openai_bodies_pass_byte_for_byte_even_with_a_broken_adapter_around() -> None:
    broken = {"bad": Adapter("bad", Path("/nowhere"), error="no adapter_config.json")}
    stub = StubApp(body=COMPLETION)
    body = '{"prompt":  "中文 \\u4e2d", "max_tokens": 2}'.encode()
    raw_call(front(stub, adapters=broken), body)
    assert stub.seen_raw == body


def test_a_cjk_prompt_is_not_doubled_by_translation() -> None:
    stub = StubApp(body=COMPLETION)
    prompt = "中文提示" * 2000
    body = json.dumps({"inputs": prompt}, ensure_ascii=False).encode()
    raw_call(front(stub), body)
    assert stub.seen_body["prompt"] == prompt and len(stub.seen_raw) <= len(body) + 32


def test_formatters_do_not_run_on_session_requests() -> None:
    def explode(payload: Any, tokenizer: Any = None) -> Any:
        raise AssertionError("ran")

    stub = StubApp(body=COMPLETION)
    app = front(stub, formatters={"fmt": Formatters("fmt", input=explode)})
    for payload, headers in (({"requestType": "NEW_SESSION"}, {"X-Amzn-SageMaker-Adapter-Identifier": "fmt"}),
                             ({"requestType": "CLOSE"}, {"X-Amzn-SageMaker-Adapter-Identifier": "fmt",
                                                         "X-Amzn-SageMaker-Session-Id": "s1"})):
        status, _, _ = run(app, payload, headers)
        assert status == 200


def test_exception_text_reaches_the_log_redacted_and_never_the_client(caplog: pytest.LogCaptureFixture) -> None:
    def leaky(payload: Any, tokenizer: Any = None) -> Any:
        raise RuntimeError("cannot open /srv/secret/db.conf with password=hunter2 via https://u:pw@db.example")

    stub = StubApp(body=COMPLETION)
    with caplog.at_level(logging.WARNING):
        status, headers, body = run(front(stub, formatters={"fmt": Formatters("fmt", input=leaky)}),
                                    {"inputs": "Q", "adapters": "fmt"})
    assert status == 424 and b"hunter2" not in body and b"/srv/secret" not in body
    request_id = json.loads(body)["request_id"]
    assert headers[b"x-request-id"] == request_id.encode()
    assert request_id in caplog.text and "/srv/secret/db.conf" in caplog.text
    assert "hunter2" not in caplog.text and "password=***" in caplog.text and "u:pw" not in caplog.text


def test_a_model_that_is_neither_the_base_model_nor_an_adapter_is_refused_before_vllm() -> None:
    stub = StubApp(body=COMPLETION)
    app = front(stub, adapters={"tenant": Adapter("tenant", Path("/a"), rank=8)}, base_names=frozenset({"base"}))
    for model in ("base", "tenant", ""):
        assert run(app, {"prompt": "Q", "model": model})[0] == 200
    calls = stub.calls
    status, _, body = run(app, {"prompt": "Q", "model": "x" * 50_000})
    assert status == 404 and stub.calls == calls and len(body) < 500
    status, _, _ = run(app, {"inputs": "Q"}, {"X-Amzn-SageMaker-Adapter-Identifier": "nobody"})
    assert status == 404
    status, _, _ = run(app, {"prompt": "Q", "model": "nobody"}, path="/v1/completions")
    assert status == 404 and stub.calls == calls
