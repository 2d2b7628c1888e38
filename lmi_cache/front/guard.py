"""Bounded request work and safe client errors for the front door (pure ASGI helpers, no vLLM).

Runs in vLLM's API server process, used by the front middleware on every
request it reads. A client mistake becomes a ``ClientError``: the client gets a
short reason and a request id (``{"error", "code", "request_id"}``), the log
gets one warning line with the details, secrets redacted. Bodies are read up
to a limit (413 as soon as the limit is passed, from ``Content-Length`` before
anything is read), JSON is parsed with a nesting limit and, when large, off
the event loop so that ``/ping`` keeps answering.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from typing import Any, Awaitable, Callable, MutableMapping

from lmi_cache.plain_files import refuse_json_constant

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

logger = logging.getLogger("lmi_cache.front")
# AWS's session library sets the root logger to ERROR when imported: the front's warnings must still show.
logger.setLevel(logging.INFO)
MAX_JSON_DEPTH = 64  # far deeper than any chat or LMI body; pydantic and json recurse per level
OFF_LOOP_BYTES = 256 << 10  # bodies past this are parsed in a worker thread
MAX_BODY_ENV = "LMI_CACHE_MAX_REQUEST_BYTES"  # set by serve (option.max_request_bytes)
MAX_SESSIONS_ENV = "LMI_CACHE_MAX_SESSIONS"  # set by serve (option.max_sessions)
MAX_HEADER_VALUE = 256  # session ids and adapter names are short; longer values are refused

_SECRET = re.compile(r"(?i)\b([\w.-]*(?:password|passwd|secret|token|api[_-]?key|credential)s?[\w.-]*)"
                     r"(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&\"']+)")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")
_SECRET_ENV = ("VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class ClientError(Exception):
    """A request the front refuses: ``reason`` goes to the client, ``detail`` only to the log."""

    def __init__(self, status: int, reason: str, detail: str = "",
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.detail = detail
        self.headers = headers or []


def redact(text: str) -> str:
    """``text`` without credentials: ``password=...``-style values, URL userinfo, known secret variables."""
    text = _SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)
    text = _USERINFO.sub(r"\1***@", text)
    for name in _SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def new_request_id() -> str:
    return os.urandom(8).hex()


async def send_error(send: Send, err: ClientError, request_id: str, path: str) -> None:
    """Answer ``err`` (LMI's error object plus the request id) and log one warning line."""
    reason = err.reason if len(err.reason) <= 400 else err.reason[:397] + "..."  # may quote the client's values
    logger.warning("lmi-cache front: %s %s -> %d %s%s", request_id, path[:200], err.status, reason,
                   f" ({redact(err.detail)})" if err.detail else "")
    data = json.dumps({"error": reason, "code": err.status, "request_id": request_id}).encode()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        *err.headers, (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        (b"x-request-id", request_id.encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def _too_large(limit: int) -> ClientError:
    return ClientError(413, f"request body over {limit} bytes; send a shorter prompt "
                            "or raise option.max_request_bytes")


def check_declared_length(scope: MutableMapping[str, Any], limit: int) -> None:
    """ClientError 413 when the request's Content-Length exceeds ``limit`` (nothing read yet)."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    if declared is not None:
        if not declared.strip().isdigit():
            raise ClientError(400, "Content-Length is not a number")
        if int(declared) > limit:
            raise _too_large(limit)


async def read_body(scope: MutableMapping[str, Any], receive: Receive, limit: int) -> bytes:
    """The whole body, or ClientError 413 as soon as it is known to exceed ``limit``."""
    check_declared_length(scope, limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, iteratively (no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
    return deepest


# Built once: json.loads with options builds a decoder per call, a measurable share of a small request.
_DECODER = json.JSONDecoder(parse_constant=refuse_json_constant)  # NaN/Infinity: vLLM's parser refuses them
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _loads(body: bytes) -> Any:
    try:
        # JSON may come in UTF-8, -16 or -32 (RFC 8259 readers detect it); vLLM gets UTF-8 back.
        data = _DECODER.decode(body.decode(json.detect_encoding(body)))
    except RecursionError:
        raise ClientError(400, f"JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ClientError(400, "the body is not valid JSON (UTF-8)", str(err)[:200]) from None
    # Cheap first: fewer opening brackets than the limit cannot nest past it.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _depth(data) > MAX_JSON_DEPTH:
        raise ClientError(400, f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
    return data


async def parse_json(body: bytes) -> Any:
    """The parsed body; ClientError 400 for invalid or too deeply nested JSON."""
    if len(body) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_loads, body)
    return _loads(body)


def encode_json(data: Any) -> bytes:
    """UTF-8 JSON without ``\\u`` escapes: a CJK prompt keeps its size when re-encoded."""
    text = _ENCODER.encode(data)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800") has no UTF-8 form: keep it escaped
        return _ASCII_ENCODER.encode(data).encode("ascii")
