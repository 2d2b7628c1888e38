"""ASGI middleware: LMI's request formats, session headers and adapters on vLLM's ``/invocations``.

Runs in vLLM's OpenAI API server process, loaded by ``lmi-cache serve`` with
``--middleware lmi_cache.front.middleware.LmiFrontMiddleware`` (vLLM's own
hook): no proxy hop. Only ``POST /invocations`` is touched; every other route
goes straight to vLLM. For an LMI payload (``inputs``) the body is rewritten
into a vLLM completion request *on the same route*, so the session and
adapter decorators of AWS's standards library that vLLM applies to
``/invocations`` still run, and the answer is rewritten into LMI's shape
(``lmi_cache.front.responses``). OpenAI ``prompt`` / ``messages`` payloads
pass unchanged apart from an ``"adapters"`` field becoming ``model``.
An adapter's own formatters (``lmi_cache.front.formatters``, opt-in) rewrite
the body before all this and vLLM's answer instead of LMI's shape.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Awaitable, Callable, MutableMapping

from lmi_cache.front.adapters import Adapter, register_with_vllm, registry_from_env
from lmi_cache.front.formatted import FormattedResponse
from lmi_cache.front.formatted import Message, Send, as_jsonlines_start, is_event_stream
from lmi_cache.front.formatted import send_json as _send_json
from lmi_cache.front.formatters import (
    FORMATTERS_ENV,
    FormatterError,
    Formatters,
    apply_input,
    load_all,
)
from lmi_cache.front.responses import StreamTranslator, completion_to_lmi, error_to_lmi
from lmi_cache.front.schema import LmiRequestPlan, LmiSchemaError, adapter_of, is_lmi_payload, to_completion_request
from lmi_cache.front.sessions import add_lmi_session_header, expired_session_error, normalize_request_headers

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ADAPTER_HEADER = b"x-amzn-sagemaker-adapter-identifier"
# vLLM 0.32 copies this header into the engine request's session_id, which the
# scheduler (and so a KV connector) sees: the hook for session-aware caching.
VLLM_SESSION_HEADER = b"x-session-id"


def build_registry(env: dict[str, str]) -> tuple[dict[str, Adapter], dict[str, Formatters]]:
    """The adapters (refused ones carry their error) and their formatters, from what serve exported."""
    adapters = registry_from_env(env)
    formatters, failed = load_all(adapters, env.get(FORMATTERS_ENV) == "true")
    for name, why in failed.items():  # a model.py that fails to import refuses its adapter (424)
        adapters[name] = replace(adapters[name], error=why)
    return adapters, formatters


# Read once per process (the folder was checked by serve at start).
_ADAPTERS, _FORMATTERS = build_registry(dict(os.environ))
register_with_vllm(_ADAPTERS)


class LmiFrontMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware) so that streamed answers are not buffered."""

    def __init__(self, app: ASGIApp, adapters: dict[str, Adapter] | None = None,
                 formatters: dict[str, Formatters] | None = None) -> None:
        self.app = app
        self.adapters = _ADAPTERS if adapters is None else adapters
        self.broken = {name: a for name, a in self.adapters.items() if not a.ok}
        self.formatters = (_FORMATTERS if adapters is None else {}) if formatters is None else formatters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/invocations" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        headers, session_id = normalize_request_headers(list(scope["headers"]))
        if session_id is not None:
            expired = expired_session_error(session_id)
            if expired is not None:
                await _send_json(send, 400, {"error": expired, "code": 400})
                return
            if not any(k == VLLM_SESSION_HEADER for k, _ in headers):
                headers.append((VLLM_SESSION_HEADER, session_id.encode("latin-1", errors="replace")))
        plan: LmiRequestPlan | None = None
        custom: Formatters | None = None
        session_request = b'"requestType"' in body
        if b'"inputs"' in body or b'"adapters"' in body or b'"model"' in body or self.broken or self.formatters:
            try:
                body, plan, custom = self._rewrite(body, headers, scope)
            except (LmiSchemaError, FormatterError) as err:
                await _send_json(send, err.status, {"error": str(err), "code": err.status})
                return
        headers = [(k, v) for k, v in headers if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        inner_scope = dict(scope, headers=headers)
        replay = _replay(body, receive)
        if custom is not None and custom.output is not None and not session_request:
            await self.app(inner_scope, replay, FormattedResponse(custom, plan, send).send)
        elif plan is not None:
            await self.app(inner_scope, replay, _LmiResponse(plan, send).send)
        elif session_request:
            await self.app(inner_scope, replay, _session_send(send))
        else:
            await self.app(inner_scope, replay, send)

    def _rewrite(self, body: bytes, headers: list[tuple[bytes, bytes]],
                 scope: Scope) -> tuple[bytes, LmiRequestPlan | None, Formatters | None]:
        try:
            data = json.loads(body)
        except ValueError:
            return body, None, None  # vLLM answers malformed JSON itself
        header = next((v.decode("latin-1") for k, v in headers if k == ADAPTER_HEADER), None)
        custom = self.formatters.get(_requested_adapter(data, header) or "")
        if custom is not None and custom.input is not None:
            data = apply_input(custom, data, _tokenizer(scope))
        plan = None
        if is_lmi_payload(data):
            data, plan = to_completion_request(data)
        elif isinstance(data, dict) and "adapters" in data:
            num = len(data["prompt"]) if isinstance(data.get("prompt"), list) else 1
            adapter = adapter_of(data, num)
            del data["adapters"]
            if adapter is not None:
                data["model"] = adapter
        model = data.get("model") if isinstance(data, dict) else None
        name = header or model
        if isinstance(name, str) and name in self.broken:
            raise LmiSchemaError(f"adapter {name!r} failed registration: {self.broken[name].error}", status=424)
        if header is None and isinstance(model, str) and model:
            # The standards library's inject_adapter_id, which vLLM applies to /invocations, overwrites
            # "model" with the adapter header, null when absent: carry the name in the header instead.
            headers.append((ADAPTER_HEADER, model.encode("latin-1", errors="replace")))
        return json.dumps(data).encode(), plan, custom


def _requested_adapter(data: Any, header: str | None) -> str | None:
    """The adapter a request names (header, ``adapters`` field, ``model``), before any rewriting."""
    if header or not isinstance(data, dict):
        return header
    if "adapters" in data:
        inputs = data.get("inputs", data.get("prompt"))
        try:
            return adapter_of(data, len(inputs) if isinstance(inputs, list) else 1)
        except LmiSchemaError:
            return None  # refused with its message further on
    model = data.get("model")
    return model if isinstance(model, str) and model else None


def _tokenizer(scope: Scope) -> Any:
    """vLLM's tokenizer for input formatters (LMI passes it); None when the server has none."""
    try:
        return scope["app"].state.engine_client.get_tokenizer()
    except Exception:  # noqa: BLE001 - no app state (tests), or a server without a tokenizer
        return None


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then wait for the client's disconnect, as the real receive would

    return replay


def _session_send(send: Send) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message, headers=add_lmi_session_header(list(message.get("headers", []))))
        await send(message)

    return wrapped


class _LmiResponse:
    """Rewrites vLLM's completion answer (JSON or SSE) into LMI's shape on the way out."""

    def __init__(self, plan: LmiRequestPlan, send: Send) -> None:
        self.plan = plan
        self.downstream = send
        self.start: Message | None = None
        self.parts: list[bytes] = []
        self.translator: StreamTranslator | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            if is_event_stream(message):
                self.translator = StreamTranslator(self.plan)
                await self.downstream(as_jsonlines_start(message))
            return
        if message["type"] != "http.response.body":
            await self.downstream(message)
            return
        chunk = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self.translator is not None:
            out = self.translator.feed(chunk) + (b"" if more else self.translator.close())
            if out or not more:
                await self.downstream({"type": "http.response.body", "body": out, "more_body": more})
            return
        self.parts.append(chunk)
        if not more:
            await self._finish()

    async def _finish(self) -> None:
        assert self.start is not None
        status = int(self.start["status"])
        raw = b"".join(self.parts)
        payload: Any
        if status == 200:
            try:
                payload = completion_to_lmi(json.loads(raw), self.plan)
            except (ValueError, KeyError, TypeError, IndexError) as err:
                status, payload = 500, {"error": f"could not read vLLM's answer: {err}", "code": 500}
        else:
            payload = error_to_lmi(status, raw)
        await _send_json(self.downstream, status, payload, list(self.start.get("headers", [])))

