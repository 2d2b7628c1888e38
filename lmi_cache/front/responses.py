"""vLLM OpenAI completion responses -> LMI's response shapes (pure).

Runs in vLLM's API server process (the front middleware) and in tests. Shapes
from djl-serving ``serving/docs/lmi/user_guides/lmi_input_output_schema.md``
(v0.31.0 page): ``{"generated_text", "details"}`` for one input, a list of
them for a list of inputs; ``details`` = ``finish_reason`` (``length``,
``eos_token``, ``stop_sequence``), ``generated_tokens``, ``inputs``,
``tokens`` (``{"id", "text", "log_prob"}``), ``prefill`` with
``decoder_input_details``, ``best_of_sequences`` when ``n`` > 1. Streaming is
LMI's default ``jsonlines`` formatter: one ``{"token": ...}`` line per token,
the last line also carrying ``generated_text`` (and ``details`` when asked).
Errors: ``{"error": message, "code": status}`` before generation; a streamed
error is LMI's error line (token id -1, ``finish_reason`` ``error``).
"""
from __future__ import annotations

import json
from typing import Any

from lmi_cache.front.schema import LmiRequestPlan

JSONLINES = "application/jsonlines"


def finish_reason(choice: dict[str, Any]) -> str | None:
    """OpenAI's finish/stop reason -> LMI's ``length`` / ``eos_token`` / ``stop_sequence``."""
    reason = choice.get("finish_reason")
    if reason is None:
        return None
    if reason == "length":
        return "length"
    if reason == "stop":
        return "eos_token" if choice.get("stop_reason") is None else "stop_sequence"
    return "error" if reason in ("abort", "error") else str(reason)


def _tokens(choice: dict[str, Any]) -> list[dict[str, Any]]:
    ids = choice.get("token_ids") or []
    logprobs = choice.get("logprobs") or {}
    texts = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    out = []
    for i, token_id in enumerate(ids):
        out.append({"id": token_id, "text": texts[i] if i < len(texts) else "",
                    "log_prob": values[i] if i < len(values) else None})
    return out


def _prefill(choice: dict[str, Any]) -> list[dict[str, Any]]:
    ids = choice.get("prompt_token_ids") or []
    entries = choice.get("prompt_logprobs") or []
    out = []
    for i, token_id in enumerate(ids):
        entry = entries[i] if i < len(entries) else None
        info = (entry or {}).get(str(token_id)) or {}
        out.append({"id": token_id, "text": info.get("decoded_token"), "log_prob": info.get("logprob")})
    return out


def _details(choice: dict[str, Any], plan: LmiRequestPlan, index: int) -> dict[str, Any]:
    details: dict[str, Any] = {
        "finish_reason": finish_reason(choice),
        "generated_tokens": len(choice.get("token_ids") or []),
        "inputs": plan.inputs[index],
        "tokens": _tokens(choice),
    }
    if plan.prefill:
        details["prefill"] = _prefill(choice)
    return details


def completion_to_lmi(response: dict[str, Any], plan: LmiRequestPlan) -> Any:
    """A non-streamed vLLM completion response -> LMI's object (one input) or list (a list of inputs)."""
    choices = sorted(response.get("choices") or [], key=lambda c: int(c.get("index", 0)))
    results: list[dict[str, Any]] = []
    for i in range(len(plan.inputs)):
        group = choices[i * plan.n:(i + 1) * plan.n]
        if not group:
            results.append({"generated_text": ""})
            continue
        first = group[0]
        item: dict[str, Any] = {"generated_text": plan.text_of(i, first.get("text") or "")}
        if plan.details:
            details = _details(first, plan, i)
            if len(group) > 1:
                details["best_of_sequences"] = [
                    {"generated_text": plan.text_of(i, c.get("text") or ""), "finish_reason": finish_reason(c),
                     "generated_tokens": len(c.get("token_ids") or []), "tokens": _tokens(c)}
                    for c in group[1:]]
            item["details"] = details
        results.append(item)
    return results if plan.batched else results[0]


def error_to_lmi(status: int, body: bytes) -> dict[str, Any]:
    """vLLM's ``{"error": {"message"...}}`` or FastAPI's ``{"detail": ...}`` -> LMI's ``{"error", "code"}``."""
    message: Any = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            message = err.get("message", message)
        elif isinstance(err, str):
            message = err
        elif "detail" in data:
            message = data["detail"]
        elif "message" in data:
            message = data["message"]
    if not isinstance(message, str):
        message = json.dumps(message)
    return {"error": message, "code": status}


def error_line() -> dict[str, Any]:
    """LMI's streamed error line (generation failed after the 200 went out)."""
    return {"token": {"id": -1, "text": "", "log_prob": -1, "special_token": True}, "generated_text": "",
            "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None}}


class StreamTranslator:
    """vLLM's SSE completion stream (``data: {...}`` events) -> LMI jsonlines, chunk by chunk.

    Feed raw body bytes as they arrive; get back the bytes to send. Events may
    be split across chunks: a partial event waits in a buffer.
    """

    def __init__(self, plan: LmiRequestPlan) -> None:
        self.plan = plan
        self._buffer = b""
        self._texts: dict[int, list[str]] = {}
        self._counts: dict[int, int] = {}
        self._done = False

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        out: list[bytes] = []
        while True:
            cut = self._buffer.find(b"\n\n")
            if cut < 0:
                break
            event, self._buffer = self._buffer[:cut], self._buffer[cut + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    out += self._event(line[5:].strip())
        return b"".join(out)

    def close(self) -> bytes:
        """Whatever a stream that ended without its final event still owes (nothing normally)."""
        rest = self.feed(b"\n\n") if self._buffer.strip() else b""
        return rest

    def _event(self, data: bytes) -> list[bytes]:
        if data == b"[DONE]" or self._done:
            return []
        try:
            chunk = json.loads(data)
        except ValueError:
            return []
        if "error" in chunk:
            self._done = True
            return [_line(error_line())]
        lines = []
        for choice in chunk.get("choices") or []:
            lines += self._choice(choice)
        return lines

    def _choice(self, choice: dict[str, Any]) -> list[bytes]:
        index = int(choice.get("index", 0))
        delta = choice.get("text") or ""
        self._texts.setdefault(index, []).append(delta)
        tokens = _tokens(choice)
        if len(tokens) == 1:
            tokens[0]["text"] = delta  # the detokenizer's delta, so the token texts add up to generated_text
        self._counts[index] = self._counts.get(index, 0) + len(tokens)
        reason = finish_reason(choice)
        if reason is not None and not tokens:
            tokens = [{"id": -1, "text": "", "log_prob": None, "special_token": True}]
        lines = []
        for i, token in enumerate(tokens):
            item: dict[str, Any] = {"token": token}
            if self.plan.batched:
                item["index"] = index
            if reason is not None and i == len(tokens) - 1:
                item["generated_text"] = self.plan.text_of(index, "".join(self._texts[index]))
                if self.plan.details:
                    item["details"] = {"finish_reason": reason, "generated_tokens": self._counts[index],
                                       "inputs": self.plan.inputs[index]}
            lines.append(_line(item))
        return lines


def _line(item: dict[str, Any]) -> bytes:
    return json.dumps(item, ensure_ascii=False).encode("utf-8") + b"\n"
