"""ASGI middleware: LMI's request formats, session headers and adapters on vLLM's ``/invocations``.

Runs in vLLM's API server process, loaded by ``lmi-cache serve`` through
``--middleware`` (vLLM's own hook; the vLLM glue module
``lmi_cache.vllm_connector.front_glue`` re-exports this class after handing
the adapters folder to vLLM): no proxy hop. ``POST /invocations`` is read
whole (up to the body limit), parsed once, and for an LMI payload
(``inputs``) rewritten into a vLLM completion request *on the same route*, so
the session and adapter decorators of AWS's standards library that vLLM
applies to ``/invocations`` still run, and the answer is rewritten into LMI's
shape (``lmi_cache.front.responses``). OpenAI ``prompt`` / ``messages``
payloads pass byte for byte unless a field must change (``"adapters"``
becoming ``model``, a client's own ``session_id``). NEW_SESSION and CLOSE are
answered here (``lmi_cache.front.session_store``). An adapter's own
formatters (``lmi_cache.front.formatters``, opt-in) rewrite the body before
all this and vLLM's answer instead of LMI's shape. The OpenAI routes get the
body limit and the model-name check; the runtime adapter routes are guarded
(``lmi_cache.front.adapter_routes``); every other route goes straight to vLLM.
"""
from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Any, Awaitable, Callable, MutableMapping

from lmi_cache.front.adapter_routes import LOAD_PATHS, SAGEMAKER_ADAPTERS, AdapterRoutes, is_adapter_route
from lmi_cache.front.adapters import Adapter, registry_from_env, registry_limits
from lmi_cache.front.formatted import FormattedResponse, Message, Send
from lmi_cache.front.formatters import FORMATTERS_ENV, FormatterError, Formatters, apply_input, load_all
from lmi_cache.front.guard import MAX_BODY_ENV, MAX_HEADER_VALUE, MAX_SESSIONS_ENV, ClientError, check_declared_length, encode_json, \
    new_request_id, parse_json, read_body, send_error
from lmi_cache.front.lmi_response import LmiResponse
from lmi_cache.front.schema import LmiRequestPlan, LmiSchemaError, adapter_of, is_lmi_payload, to_completion_request
from lmi_cache.front.session_store import DEFAULT_MAX_SESSIONS, SessionGate
from lmi_cache.front.sessions import NEW_SESSION_HEADER, SESSION_HEADER, expired_session_error, \
    normalize_request_headers

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ADAPTER_HEADER = b"x-amzn-sagemaker-adapter-identifier"
DEFAULT_MAX_BODY_BYTES = 8 << 20  # when serve did not size it from max_model_len
_PRINTABLE = re.compile(rb"[\x21-\x7e]*")  # a header value without spaces or control bytes
OPENAI_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


def build_registry(env: dict[str, str]) -> tuple[dict[str, Adapter], dict[str, Formatters]]:
    """The adapters (refused ones carry their error) and their formatters, from what serve exported."""
    adapters = registry_from_env(env)
    formatters, failed = load_all(adapters, env.get(FORMATTERS_ENV) == "true")
    for name, why in failed.items():  # a model.py that fails to import refuses its adapter (424)
        adapters[name] = replace(adapters[name], error=why)
    return adapters, formatters


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else default


# Read once per process (the folder was checked by serve at start).
ADAPTERS, FORMATTERS = build_registry(dict(os.environ))


# vLLM then serves any model name, so the front must not refuse unknown ones either.
_ANY_MODEL_NAME = os.environ.get("VLLM_SKIP_MODEL_NAME_VALIDATION", "").lower() in ("1", "true")


def _base_names(scope: Scope) -> frozenset[str] | None:
    """The served model names; None when unknown (no app state, or vLLM told to accept any name)."""
    # vLLM keeps them in app.state.openai_serving_models.base_model_paths (vllm/entrypoints/openai/models).
    models = getattr(getattr(scope.get("app"), "state", None), "openai_serving_models", None)
    paths = getattr(models, "base_model_paths", None)
    if _ANY_MODEL_NAME or not paths:
        return None
    return frozenset(str(p.name) for p in paths)


class LmiFrontMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware) so that streamed answers are not buffered."""

    def __init__(self, app: ASGIApp, adapters: dict[str, Adapter] | None = None,
                 formatters: dict[str, Formatters] | None = None, *, max_body: int | None = None,
                 sessions: SessionGate | None = None, routes: AdapterRoutes | None = None,
                 base_names: frozenset[str] | None = None) -> None:
        self.app = app
        self.adapters = ADAPTERS if adapters is None else adapters
        self.broken = {name: a for name, a in self.adapters.items() if not a.ok}
        self.formatters = (FORMATTERS if adapters is None else {}) if formatters is None else formatters
        self.max_body = max_body or _env_int(MAX_BODY_ENV, DEFAULT_MAX_BODY_BYTES)
        self.sessions = sessions or SessionGate(_env_int(MAX_SESSIONS_ENV, DEFAULT_MAX_SESSIONS))
        self.routes = routes or AdapterRoutes.from_env(self.adapters, dict(os.environ), *registry_limits())
        self.base_names = base_names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method, request_id = scope["path"], scope["method"], new_request_id()
        try:
            if method == "POST" and path == "/invocations":
                forward = await self._invocations(scope, receive, send, request_id)
            elif method == "POST" and path in OPENAI_ROUTES:
                forward = await self._openai(scope, receive, send)
            elif method in ("POST", "DELETE") and is_adapter_route(path):
                forward = await self._adapter_route(scope, receive, send, path)
            else:
                check_declared_length(scope, self.max_body)  # other routes read their own bodies
                forward = (scope, receive, send)
        except ClientError as err:
            await send_error(send, err, request_id, path)
            return
        if forward is not None:
            await self.app(*forward)

    async def _openai(self, scope: Scope, receive: Receive, send: Send) -> tuple[Scope, Receive, Send]:
        body = await read_body(scope, receive, self.max_body)
        data = await parse_json(body)
        model = data.get("model") if isinstance(data, dict) else None
        if isinstance(model, str):
            self.routes.check_model(model, self._served(scope))
        return scope, _replay(body, receive), send

    def _served(self, scope: Scope) -> frozenset[str] | None:
        if self.base_names is None:
            self.base_names = _base_names(scope)
        return self.base_names

    async def _invocations(self, scope: Scope, receive: Receive, send: Send,
                           request_id: str) -> tuple[Scope, Receive, Send] | None:
        body = await read_body(scope, receive, self.max_body)
        data = await parse_json(body)
        if not isinstance(data, dict):
            raise ClientError(400, "the body must be a JSON object (LMI's {\"inputs\": ...} or an OpenAI request)")
        creating = data.get("requestType") == "NEW_SESSION"
        headers, session_id = normalize_request_headers(list(scope["headers"]), creating)
        if "requestType" in data:
            await self._session_verb(data, session_id, send)
            return None
        if session_id is not None:
            expired = expired_session_error(session_id)
            if expired is not None:
                raise ClientError(400, expired)
        changed = _drop_client_session_id(data)
        header = next((v for k, v in headers if k == ADAPTER_HEADER), None)
        if header is not None and (len(header) > MAX_HEADER_VALUE or not _PRINTABLE.fullmatch(header)):
            raise ClientError(400, "X-Amzn-SageMaker-Adapter-Identifier: not an adapter name")
        name = header.decode("ascii") if header else None
        original = data
        data, plan, custom = self._rewrite(data, name, scope, headers)
        changed = changed or data is not original or plan is not None or custom is not None
        out = encode_json(data) if changed else body
        headers = [(k, v) for k, v in headers if k != b"content-length"]
        headers.append((b"content-length", str(len(out)).encode()))
        inner = dict(scope, headers=headers)
        if custom is not None and custom.output is not None:
            return inner, _replay(out, receive), FormattedResponse(custom, plan, send, request_id).send
        if plan is not None:
            return inner, _replay(out, receive), LmiResponse(plan, send, request_id).send
        return inner, _replay(out, receive), send

    def _rewrite(self, data: dict[str, Any], header: str | None, scope: Scope, headers: list[tuple[bytes, bytes]],
                 ) -> tuple[dict[str, Any], LmiRequestPlan | None, Formatters | None]:
        custom = self.formatters.get(_requested_adapter(data, header) or "")
        try:
            if custom is not None and custom.input is not None:
                data = apply_input(custom, data, _tokenizer(scope))
                _drop_client_session_id(data)
            plan = None
            if is_lmi_payload(data):
                data, plan = to_completion_request(data)
            elif "adapters" in data:
                num = len(data["prompt"]) if isinstance(data.get("prompt"), list) else 1
                adapter = adapter_of(data, num)
                data = {k: v for k, v in data.items() if k != "adapters"}
                if adapter is not None:
                    data["model"] = adapter
        except FormatterError as err:
            raise ClientError(err.status, err.reason, str(err)) from None
        except LmiSchemaError as err:
            raise ClientError(err.status, str(err)) from None
        model = data.get("model")
        name = header or model
        if isinstance(name, str) and name in self.broken:
            raise ClientError(424, f"adapter {name!r} failed registration; the server log says why",
                              self.broken[name].error or "")
        if isinstance(name, str):
            self.routes.check_model(name, self._served(scope))
        if header is None and isinstance(model, str) and model:
            # The standards library's inject_adapter_id, which vLLM applies to /invocations, overwrites
            # "model" with the adapter header, null when absent: carry the name in the header instead.
            headers.append((ADAPTER_HEADER, model.encode("latin-1", errors="replace")))
        return data, plan, custom

    async def _session_verb(self, data: dict[str, Any], session_id: str | None, send: Send) -> None:
        verb = data.get("requestType")
        if len(data) != 1 or verb not in ("NEW_SESSION", "CLOSE"):
            raise ClientError(400, 'a session request is {"requestType": "NEW_SESSION"} or '
                                   '{"requestType": "CLOSE"} and nothing else')
        if verb == "NEW_SESSION":
            try:
                new_id, value = self.sessions.create()
            except OSError as err:
                raise ClientError(500, "could not create the session", str(err)) from None
            headers = [(NEW_SESSION_HEADER, value.encode()), (SESSION_HEADER, value.encode())]
            await _send_text(send, f"Session {new_id} created", headers)
            return
        if session_id is None:
            raise ClientError(400, "CLOSE needs the session id in X-Amzn-SageMaker-Session-Id")
        try:
            self.sessions.close(session_id)
        except OSError as err:
            raise ClientError(500, "could not remove the session's data", str(err)) from None
        await _send_text(send, f"Session {session_id} closed",
                         [(b"x-amzn-sagemaker-closed-session-id", session_id.encode())])

    async def _adapter_route(self, scope: Scope, receive: Receive, send: Send,
                             path: str) -> tuple[Scope, Receive, Send]:
        body = await read_body(scope, receive, self.max_body)
        data = await parse_json(body) if body.strip() else None
        if scope["method"] == "POST" and (path in LOAD_PATHS or path == SAGEMAKER_ADAPTERS):
            name, folder, data = self.routes.load_request(path, data, scope.get("query_string", b""))
            body = encode_json(data)
            headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-type")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            scope = dict(scope, headers=headers)

            def done() -> None:
                self.routes.runtime[name] = folder
        else:
            name = self.routes.unload_name(path, data)

            def done() -> None:
                self.routes.runtime.pop(name, None)
        return scope, _replay(body, receive), _on_success(send, done)


def _drop_client_session_id(data: dict[str, Any]) -> bool:
    """Remove a session id the client put in the body (vLLM would prefer it to the validated header)."""
    changed = data.pop("session_id", None) is not None
    xargs = data.get("vllm_xargs")
    if isinstance(xargs, dict) and "session_id" in xargs:
        data["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "session_id"}
        changed = True
    return changed


def _requested_adapter(data: dict[str, Any], header: str | None) -> str | None:
    """The adapter a request names (header, ``adapters`` field, ``model``), before any rewriting."""
    if header:
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


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then wait for the client's disconnect, as the real receive would

    return replay


def _on_success(send: Send, done: Callable[[], None]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start" and int(message["status"]) == 200:
            done()
        await send(message)

    return wrapped


async def _send_text(send: Send, text: str, headers: list[tuple[bytes, bytes]]) -> None:
    data = text.encode()
    await send({"type": "http.response.start", "status": 200, "headers": [
        *headers, (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})
