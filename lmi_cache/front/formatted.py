"""An adapter's output formatter applied to vLLM's answer on its way out (ASGI send wrapper).

Runs in vLLM's API server process, used by the front middleware for requests
that name an adapter with an ``@output_formatter`` (``lmi_cache.front.formatters``).
The formatter replaces LMI's response shape, as in LMI
(djl-serving ``djl_python/lmi_vllm/vllm_async_service.py``: with a custom
formatter the raw vLLM answer goes to it, each chunk when streaming).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable, MutableMapping

from lmi_cache.front.formatters import FormatterError, Formatters, apply_output
from lmi_cache.front.guard import redact
from lmi_cache.front.responses import JSONLINES, error_line, error_to_lmi
from lmi_cache.front.schema import LmiRequestPlan

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
logger = logging.getLogger("lmi_cache.front")


def log_failure(request_id: str, what: str, detail: str) -> None:
    """The details of a failure whose client answer carries only ``what`` and the request id."""
    logger.warning("lmi-cache front: %s %s (%s)", request_id, what, redact(detail))


def is_event_stream(start: Message) -> bool:
    """A successful server-sent-events answer (vLLM streaming), which the front turns into jsonlines."""
    content_type = dict(start.get("headers", [])).get(b"content-type", b"")
    return bool(start["status"] == 200 and content_type.startswith(b"text/event-stream"))


def as_jsonlines_start(start: Message) -> Message:
    """The response start re-labelled as LMI's jsonlines (the length changes, so it is dropped)."""
    headers = [(k, v) for k, v in start.get("headers", []) if k not in (b"content-type", b"content-length")]
    return dict(start, headers=[*headers, (b"content-type", JSONLINES.encode())])


async def send_json(send: Send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(payload).encode()
    kept = [(k, v) for k, v in headers or [] if k not in (b"content-type", b"content-length")]
    await send({"type": "http.response.start", "status": status, "headers": [
        *kept, (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class FormattedResponse:
    """vLLM's answer through the adapter's output formatter (instead of LMI's shape), JSON or streamed.

    Streamed: each SSE event's JSON goes through the formatter, one jsonlines
    line out per event; a formatter that raises, or an error event from vLLM,
    ends the stream with LMI's error line (its ``error`` says why). Errors
    before the stream keep their status (LMI's error shape for an LMI
    payload, vLLM's own otherwise).
    """

    def __init__(self, formatters: Formatters, plan: LmiRequestPlan | None, send: Send,
                 request_id: str = "") -> None:
        self.formatters = formatters
        self.request_id = request_id
        self.plan = plan
        self.downstream = send
        self.start: Message | None = None
        self.parts: list[bytes] = []
        self.streaming = False
        self.buffer = b""
        self.failed = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            self.streaming = is_event_stream(message)
            if self.streaming:
                await self.downstream(as_jsonlines_start(message))
            return
        if message["type"] != "http.response.body":
            await self.downstream(message)
            return
        more = bool(message.get("more_body", False))
        if self.streaming:
            out = self._events(message.get("body", b"") + (b"" if more else b"\n\n"))
            if out or not more:
                await self.downstream({"type": "http.response.body", "body": out, "more_body": more})
            return
        self.parts.append(message.get("body", b""))
        if not more:
            await self._finish()

    def _events(self, chunk: bytes) -> bytes:
        self.buffer += chunk
        out: list[bytes] = []
        while (cut := self.buffer.find(b"\n\n")) >= 0:
            event, self.buffer = self.buffer[:cut], self.buffer[cut + 2:]
            for line in event.split(b"\n"):
                data = line[5:].strip() if line.startswith(b"data:") else b""
                if not data or data == b"[DONE]" or self.failed:
                    continue
                try:
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and "error" in chunk:  # vLLM failed mid-stream: not formatted
                        raise FormatterError(error_to_lmi(500, data)["error"])
                    text = apply_output(self.formatters, chunk)
                except ValueError:
                    continue  # not JSON: nothing a formatter could read
                except FormatterError as err:
                    self.failed = True
                    log_failure(self.request_id, err.reason, str(err))
                    text = json.dumps({**error_line(), "error": err.reason, "request_id": self.request_id}).encode()
                out.append(text if text.endswith(b"\n") else text + b"\n")
        return b"".join(out)

    async def _finish(self) -> None:
        assert self.start is not None
        status = int(self.start["status"])
        raw = b"".join(self.parts)
        headers = list(self.start.get("headers", []))
        if status != 200:
            if self.plan is not None:
                await send_json(self.downstream, status, error_to_lmi(status, raw), headers)
                return
            await self.downstream(self.start)
            await self.downstream({"type": "http.response.body", "body": raw, "more_body": False})
            return
        try:
            out = apply_output(self.formatters, json.loads(raw))
        except ValueError as err:
            log_failure(self.request_id, "could not read vLLM's answer", str(err))
            status, out = 500, json.dumps({"error": "could not read vLLM's answer", "code": 500,
                                           "request_id": self.request_id}).encode()
        except FormatterError as err:
            log_failure(self.request_id, err.reason, str(err))
            status, out = err.status, json.dumps({"error": err.reason, "code": err.status,
                                                  "request_id": self.request_id}).encode()
        try:
            json.loads(out)
            content_type = b"application/json"
        except ValueError:
            content_type = b"text/plain; charset=utf-8"
        kept = [(k, v) for k, v in headers if k not in (b"content-type", b"content-length")]
        await self.downstream({"type": "http.response.start", "status": status, "headers": [
            *kept, (b"content-type", content_type), (b"content-length", str(len(out)).encode())]})
        await self.downstream({"type": "http.response.body", "body": out, "more_body": False})
