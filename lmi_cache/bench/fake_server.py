"""A tiny fake OpenAI-compatible server for testing the bench without vLLM.

Runs in a background thread of the test (or CI smoke) process, on 127.0.0.1
only. A "token" is a whitespace-separated word. Prefill takes
``prefill_s_per_token`` for every token not covered by a prefix seen before
(a block-granular prefix cache, like vLLM's), so a repeated document answers
faster: that lets tests check that the bench measures reuse. It serves
``/v1/models``, ``/tokenize`` and streamed ``/v1/completions``.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from types import TracebackType

from aiohttp import web

BLOCK_TOKENS = 16


@dataclass
class FakeServerState:
    model: str = "fake-model"
    prefill_s_per_token: float = 0.0001
    decode_s_per_token: float = 0.001
    prefix_cache: bool = True
    # When set, /v1/completions answers this HTTP status instead of streaming.
    fail_status: int | None = None
    cached_blocks: set[str] = field(default_factory=set)
    prompts: list[str] = field(default_factory=list)
    num_in_flight: int = 0
    max_in_flight: int = 0

    def uncached_tokens(self, words: list[str]) -> int:
        """Tokens to prefill; records the prompt's full blocks as cached."""
        digest = hashlib.sha256()
        num_cached_blocks = 0
        still_hitting = True
        for start in range(0, len(words) - len(words) % BLOCK_TOKENS, BLOCK_TOKENS):
            digest.update(" ".join(words[start : start + BLOCK_TOKENS]).encode() + b"\0")
            key = digest.hexdigest()
            if still_hitting and self.prefix_cache and key in self.cached_blocks:
                num_cached_blocks += 1
            else:
                still_hitting = False
            self.cached_blocks.add(key)
        return len(words) - num_cached_blocks * BLOCK_TOKENS


def _sse(payload: dict[str, object] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def build_app(state: FakeServerState) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": state.model, "object": "model"}]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        count = len(str(body.get("prompt", "")).split())
        return web.json_response({"count": count, "max_model_len": 1 << 20, "tokens": list(range(count))})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") != state.model:
            return web.json_response({"error": {"message": f"model {body.get('model')} not found"}}, status=404)
        if state.fail_status is not None:
            return web.json_response({"error": {"message": "injected failure"}}, status=state.fail_status)
        prompt = str(body["prompt"])
        state.prompts.append(prompt)
        state.num_in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.num_in_flight)
        try:
            return await _stream(request, body, prompt.split())
        finally:
            state.num_in_flight -= 1

    async def _stream(request: web.Request, body: dict[str, object], words: list[str]) -> web.StreamResponse:
        await asyncio.sleep(state.prefill_s_per_token * state.uncached_tokens(words))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        max_tokens = int(str(body.get("max_tokens", 16)))
        for index in range(max_tokens):
            if index:
                await asyncio.sleep(state.decode_s_per_token)
            # Deterministic output that depends on the prompt, like greedy decoding.
            token = f" w{(len(words) + index) % 97}"
            await response.write(_sse({"choices": [{"index": 0, "text": token, "finish_reason": None}]}))
        usage = {"prompt_tokens": len(words), "completion_tokens": max_tokens}
        await response.write(_sse({"choices": [], "usage": usage}))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    return app


class FakeOpenAiServer:
    """``with FakeOpenAiServer() as server: server.url`` — serves from a thread."""

    def __init__(self, state: FakeServerState | None = None) -> None:
        self.state = state or FakeServerState()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-openai", daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self._runner = web.AppRunner(build_app(self.state))
        await self._runner.setup()
        # Bind the socket here so the kernel-chosen port is known before serving.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    def __enter__(self) -> FakeOpenAiServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
