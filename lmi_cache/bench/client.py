"""Async OpenAI-compatible client that measures TTFT and latency (bench process).

Uses aiohttp (installed with vLLM). Completions go to ``/v1/completions`` with
``stream: true`` and ``temperature: 0``: time to first token is the arrival of
the first server-sent event that carries generated text, which is what a user
waiting on a stream sees. Token counting asks the server's ``/tokenize``
(vLLM's extension) so that "L tokens" means L tokens of the served model.

Every transport or HTTP failure becomes a ``BenchError``: one line naming the
URL and what to do, never a traceback.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

from lmi_cache.errors import UserError


class BenchError(UserError):
    """The benchmark cannot go on (server unreachable, HTTP error, bad reply)."""


@dataclass(frozen=True)
class CompletionResult:
    """One streamed completion: times are seconds from sending the request."""

    ttft_s: float
    latency_s: float
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from a URL given with or without a trailing ``/v1``."""
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    if not base.startswith(("http://", "https://")):
        raise BenchError(f"--url {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8080")
    return base


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class OpenAiClient:
    """A session against one server; use as ``async with OpenAiClient(...) as client``."""

    def __init__(
        self,
        base_url: str,
        model: str | None,
        *,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._extra_body = dict(extra_body or {})
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAiClient:
        # limit=0: the runner's semaphore is the only concurrency limit.
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers, connector=connector)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("OpenAiClient used outside 'async with'")
        return self._session

    def _transport_error(self, path: str, err: Exception) -> BenchError:
        if isinstance(err, aiohttp.ClientConnectorError):
            return BenchError(f"cannot connect to {self.base_url}{path}: {_one_line(str(err.os_error))}; is the server running (--url)?")
        if isinstance(err, TimeoutError):
            return BenchError(f"{self.base_url}{path} timed out; raise --timeout or check the server")
        return BenchError(f"request to {self.base_url}{path} failed: {type(err).__name__}: {_one_line(str(err))}")

    async def _http_error(self, path: str, response: aiohttp.ClientResponse) -> BenchError:
        body = await response.text()
        hint = "check --model" if response.status == 404 else "see the server's message and log"
        return BenchError(f"{response.method} {self.base_url}{path} returned HTTP {response.status}: {_one_line(body)}; {hint}")

    async def resolve_model(self) -> str:
        """The model to ask for: ``model`` if given, else the server's first listed model."""
        if self.model:
            return self.model
        path = "/v1/models"
        try:
            async with self.session.get(self.base_url + path) as response:
                if response.status != 200:
                    raise await self._http_error(path, response)
                listing = await response.json(content_type=None)
        except aiohttp.ClientError as err:
            raise self._transport_error(path, err) from None
        except TimeoutError as err:
            raise self._transport_error(path, err) from None
        models = [entry.get("id") for entry in listing.get("data", []) if isinstance(entry, dict)]
        if not models or not models[0]:
            raise BenchError(f"{self.base_url}{path} lists no model; pass --model")
        self.model = str(models[0])
        return self.model

    async def count_tokens(self, text: str) -> int | None:
        """Tokens of ``text`` per the server's ``/tokenize``; None if it has none."""
        path = "/tokenize"
        payload = {"model": self.model, "prompt": text, "add_special_tokens": False}
        try:
            async with self.session.post(self.base_url + path, json=payload) as response:
                if response.status in (404, 405, 501):
                    return None
                if response.status != 200:
                    raise await self._http_error(path, response)
                reply = await response.json(content_type=None)
        except aiohttp.ClientError as err:
            raise self._transport_error(path, err) from None
        except TimeoutError as err:
            raise self._transport_error(path, err) from None
        count = reply.get("count")
        if count is None and isinstance(reply.get("tokens"), list):
            count = len(reply["tokens"])
        if not isinstance(count, int):
            raise BenchError(f"{self.base_url}{path} replied without a token count; pass --tokenizer PATH")
        return count

    async def complete(self, prompt: str, max_tokens: int) -> CompletionResult:
        """Send one streamed completion and time it."""
        path = "/v1/completions"
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self._extra_body,
        }
        started = time.perf_counter()
        try:
            async with self.session.post(self.base_url + path, json=payload) as response:
                if response.status != 200:
                    raise await self._http_error(path, response)
                return await self._read_stream(path, response, started)
        except aiohttp.ClientError as err:
            raise self._transport_error(path, err) from None
        except TimeoutError as err:
            raise self._transport_error(path, err) from None

    async def _read_stream(self, path: str, response: aiohttp.ClientResponse, started: float) -> CompletionResult:
        first_text_at: float | None = None
        first_event_at: float | None = None
        pieces: list[str] = []
        usage: dict[str, Any] = {}
        async for raw_line in response.content:
            line = raw_line.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                raise BenchError(f"{self.base_url}{path} sent a malformed stream event: {_one_line(data)}") from None
            if "error" in event:
                raise BenchError(f"{self.base_url}{path} reported an error mid-stream: {_one_line(json.dumps(event['error']))}")
            now = time.perf_counter()
            for choice in event.get("choices") or []:
                if first_event_at is None:
                    first_event_at = now
                text = choice.get("text") or ""
                if text:
                    if first_text_at is None:
                        first_text_at = now
                    pieces.append(text)
            if event.get("usage"):
                usage = event["usage"]
        finished = time.perf_counter()
        # A first token can decode to no text (a partial UTF-8 sequence): fall
        # back to the first choice event, then to the end of the stream.
        first = first_text_at or first_event_at or finished
        return CompletionResult(
            ttft_s=first - started,
            latency_s=finished - started,
            text="".join(pieces),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
        )
