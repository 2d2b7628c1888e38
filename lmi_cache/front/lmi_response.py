"""vLLM's completion answer (JSON or SSE) rewritten into LMI's shape on its way out (ASGI send wrapper).

Runs in vLLM's API server process, used by the front middleware for LMI
payloads (``inputs``): a JSON answer becomes LMI's object or list
(``lmi_cache.front.responses.completion_to_lmi``), an SSE stream becomes
LMI's jsonlines, and vLLM's errors keep their status in LMI's error shape.
"""
from __future__ import annotations

import json
from typing import Any

from lmi_cache.front.formatted import Message, Send, as_jsonlines_start, is_event_stream, log_failure, send_json
from lmi_cache.front.responses import StreamTranslator, completion_to_lmi, error_to_lmi
from lmi_cache.front.schema import LmiRequestPlan


class LmiResponse:
    """Buffers a JSON answer (to rewrite it whole) and translates a stream chunk by chunk."""

    def __init__(self, plan: LmiRequestPlan, send: Send, request_id: str = "") -> None:
        self.plan = plan
        self.downstream = send
        self.request_id = request_id
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
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
                log_failure(self.request_id, "could not read vLLM's answer", f"{type(err).__name__}: {err}")
                status, payload = 500, {"error": "could not read vLLM's answer", "code": 500,
                                        "request_id": self.request_id}
        else:
            payload = error_to_lmi(status, raw)
        await send_json(self.downstream, status, payload, list(self.start.get("headers", [])))
