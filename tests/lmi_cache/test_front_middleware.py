"""The front middleware around a stub ASGI app (no vLLM): what reaches vLLM and what reaches the client."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, MutableMapping

from lmi_cache.front.adapters import Adapter
from lmi_cache.front.middleware import LmiFrontMiddleware
from lmi_cache.front.session_store import SessionGate

Message = MutableMapping[str, Any]


class StubApp:
    """Records the request it got; answers with a canned status/body (or SSE chunks)."""

    def __init__(self, status: int = 200, body: Any = None, sse: list[bytes] | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status, self.body, self.sse, self.extra_headers = status, body, sse, headers or []
        self.seen_body: Any = None
        self.seen_raw = b""
        self.seen_headers: dict[bytes, bytes] = {}
        self.calls = 0

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        self.calls += 1
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen_raw = raw
        self.seen_body = json.loads(raw) if raw else None
        self.seen_headers = dict(scope["headers"])
        if self.sse is not None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            for i, chunk in enumerate(self.sse):
                await send({"type": "http.response.body", "body": chunk, "more_body": i < len(self.sse) - 1})
            return
        data = json.dumps(self.body).encode()
        await send({"type": "http.response.start", "status": self.status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            *self.extra_headers]})
        await send({"type": "http.response.body", "body": data, "more_body": False})


def run(app: Any, payload: Any, headers: dict[str, str] | None = None,
        path: str = "/invocations") -> tuple[int, dict[bytes, bytes], bytes]:
    body = json.dumps(payload).encode()
    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    chunks = [{"type": "http.request", "body": body[:5], "more_body": True},
              {"type": "http.request", "body": body[5:], "more_body": False}]
    out: list[Message] = []

    async def receive() -> Message:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        out.append(message)

    asyncio.run(app(scope, receive, send))
    start = out[0]
    return (int(start["status"]), dict(start["headers"]),
            b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body"))


COMPLETION = {"choices": [{"index": 0, "text": " hi", "finish_reason": "length"}]}


class FakeSessions(SessionGate):
    """Session ids s1, s2, ... without AWS's library (the gate's own logic is tested on a real manager)."""

    def __init__(self) -> None:
        super().__init__(manager=None)
        self.opened: list[str] = []
        self.closed: list[str] = []

    def create(self) -> tuple[str, str]:
        self.opened.append(f"s{len(self.opened) + 1}")
        return self.opened[-1], f"{self.opened[-1]}; Expires=2030-01-01T00:00:00Z"

    def close(self, session_id: str) -> None:
        self.closed.append(session_id)


def test_an_lmi_request_reaches_vllm_as_a_completion_and_returns_lmis_shape() -> None:
    stub = StubApp(body=COMPLETION)
    status, headers, body = run(LmiFrontMiddleware(stub, adapters={}),
                                {"inputs": "Q", "parameters": {"max_new_tokens": 3, "do_sample": False}})
    assert stub.seen_body == {"prompt": "Q", "max_tokens": 3, "temperature": 0.0}
    assert stub.seen_headers[b"content-length"] == str(len(stub.seen_raw)).encode()
    assert status == 200 and json.loads(body) == {"generated_text": " hi"}
    assert headers[b"content-length"] == str(len(body)).encode()


def test_a_bad_parameter_is_answered_400_without_reaching_vllm() -> None:
    stub = StubApp(body=COMPLETION)
    status, _, body = run(LmiFrontMiddleware(stub, adapters={}), {"inputs": "Q", "parameters": {"foo": 1}})
    assert status == 400 and stub.calls == 0
    assert json.loads(body)["code"] == 400 and "parameters.foo" in json.loads(body)["error"]


def test_vllm_errors_on_an_lmi_request_keep_their_status_in_lmis_error_shape() -> None:
    stub = StubApp(status=400, body={"error": {"message": "prompt too long", "code": 400}})
    status, _, body = run(LmiFrontMiddleware(stub, adapters={}), {"inputs": "Q"})
    assert status == 400 and json.loads(body) == {"error": "prompt too long", "code": 400}


def test_a_streamed_lmi_request_is_rewritten_to_jsonlines() -> None:
    event = {"choices": [{"index": 0, "text": " a", "token_ids": [4], "finish_reason": "length",
                          "logprobs": {"tokens": [" a"], "token_logprobs": [-1.0]}}]}
    raw = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
    stub = StubApp(sse=[raw[:7], raw[7:], b""])
    status, headers, body = run(LmiFrontMiddleware(stub, adapters={}), {"inputs": "Q", "stream": True})
    assert status == 200 and headers[b"content-type"] == b"application/jsonlines"
    assert json.loads(body) == {"token": {"id": 4, "text": " a", "log_prob": -1.0}, "generated_text": " a"}


def test_openai_payloads_pass_unchanged_and_other_routes_are_untouched() -> None:
    stub = StubApp(body=COMPLETION)
    _, _, body = run(LmiFrontMiddleware(stub, adapters={}), {"prompt": "Q", "max_tokens": 2})
    assert stub.seen_body == {"prompt": "Q", "max_tokens": 2} and json.loads(body) == COMPLETION
    _, _, body = run(LmiFrontMiddleware(stub, adapters={}), {"inputs": "Q"}, path="/v1/completions")
    assert stub.seen_body == {"inputs": "Q"}


def test_an_adapters_field_or_model_field_travels_in_the_adapter_header_too() -> None:
    stub = StubApp(body=COMPLETION)
    run(LmiFrontMiddleware(stub, adapters={}), {"prompt": "Q", "adapters": ["t1"]})
    assert stub.seen_body == {"prompt": "Q", "model": "t1"}
    # vLLM's /invocations overwrites "model" from this header (null without it).
    assert stub.seen_headers[b"x-amzn-sagemaker-adapter-identifier"] == b"t1"
    run(LmiFrontMiddleware(stub, adapters={}), {"prompt": "Q", "model": "t2"}, {"X-Amzn-SageMaker-Adapter-Identifier": "t3"})
    assert stub.seen_headers[b"x-amzn-sagemaker-adapter-identifier"] == b"t3"


def test_a_broken_adapter_is_answered_424_by_header_field_or_model() -> None:
    broken = {"bad": Adapter("bad", Path("/nowhere"), error="no adapter_config.json")}
    for payload, headers in (({"inputs": "Q"}, {"X-Amzn-SageMaker-Adapter-Identifier": "bad"}),
                             ({"inputs": "Q", "adapters": "bad"}, {}),
                             ({"prompt": "Q", "model": "bad"}, {})):
        stub = StubApp(body=COMPLETION)
        status, _, body = run(LmiFrontMiddleware(stub, adapters=broken), payload, headers)
        assert status == 424 and stub.calls == 0
        assert json.loads(body)["error"] == "adapter 'bad' failed registration; the server log says why"


def test_session_ids_are_passed_bare_whichever_header_carries_them() -> None:
    stub = StubApp(body=COMPLETION)
    front = LmiFrontMiddleware(stub, adapters={})
    run(front, {"prompt": "Q"}, {"X-Amzn-SageMaker-Session-Id": "abc; Expires=2030-01-01T00:00:00Z"})
    assert stub.seen_headers[b"x-amzn-sagemaker-session-id"] == b"abc"
    run(front, {"prompt": "Q"}, {"X-Amzn-SageMaker-New-Session-Id": "def; Expires=2030-01-01T00:00:00Z"})
    assert stub.seen_headers[b"x-amzn-sagemaker-session-id"] == b"def"
    assert b"x-amzn-sagemaker-new-session-id" not in stub.seen_headers
    # vLLM turns X-Session-ID into the engine request's session_id (seen by the KV connector).
    assert stub.seen_headers[b"x-session-id"] == b"def"
    run(front, {"prompt": "Q"})
    assert b"x-session-id" not in stub.seen_headers


def test_a_new_session_answer_carries_both_session_headers_and_close_names_the_session() -> None:
    stub = StubApp(body=COMPLETION)
    sessions = FakeSessions()
    front = LmiFrontMiddleware(stub, adapters={}, sessions=sessions)
    status, headers, body = run(front, {"requestType": "NEW_SESSION"})
    value = b"s1; Expires=2030-01-01T00:00:00Z"
    assert status == 200 and body == b"Session s1 created" and stub.calls == 0
    assert headers[b"x-amzn-sagemaker-session-id"] == value and headers[b"x-amzn-sagemaker-new-session-id"] == value
    status, headers, _ = run(front, {"requestType": "CLOSE"}, {"X-Amzn-SageMaker-Session-Id": value.decode()})
    assert status == 200 and headers[b"x-amzn-sagemaker-closed-session-id"] == b"s1" and sessions.closed == ["s1"]


# SageMaker's InvokeEndpoint(SessionId="NEW_SESSION") forwards this header with the create payload.
SAGEMAKER_NEW_SESSION = {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"}


def test_sagemakers_create_request_with_the_new_session_header_opens_a_session() -> None:
    stub = StubApp(body=COMPLETION)
    sessions = FakeSessions()
    front = LmiFrontMiddleware(stub, adapters={}, sessions=sessions)
    status, headers, body = run(front, {"requestType": "NEW_SESSION"}, SAGEMAKER_NEW_SESSION)
    assert status == 200 and body == b"Session s1 created" and stub.calls == 0
    assert headers[b"x-amzn-sagemaker-new-session-id"] == b"s1; Expires=2030-01-01T00:00:00Z"
    status, headers, _ = run(front, {"requestType": "CLOSE"}, {"X-Amzn-SageMaker-Session-Id": "s1"})
    assert status == 200 and headers[b"x-amzn-sagemaker-closed-session-id"] == b"s1" and sessions.closed == ["s1"]


def test_a_plain_request_with_the_new_session_header_is_served_without_a_session() -> None:
    stub = StubApp(body=COMPLETION)
    front = LmiFrontMiddleware(stub, adapters={}, sessions=FakeSessions())
    status, _, _ = run(front, {"prompt": "Q"}, SAGEMAKER_NEW_SESSION)
    assert status == 200 and stub.calls == 1
    assert b"x-session-id" not in stub.seen_headers and b"x-amzn-sagemaker-session-id" not in stub.seen_headers


def test_close_with_the_new_session_header_still_asks_for_the_id() -> None:
    stub = StubApp(body=COMPLETION)
    status, _, body = run(LmiFrontMiddleware(stub, adapters={}, sessions=FakeSessions()), {"requestType": "CLOSE"},
                          SAGEMAKER_NEW_SESSION)
    assert status == 400 and b"CLOSE needs the session id" in body and stub.calls == 0
