"""Token counting for sizing benchmark prompts (bench process).

Three sources, best first: the server's ``/tokenize``, a local tokenizer
(``--tokenizer PATH``: a folder or a ``tokenizer.json``), or an approximation
from the word count. ``fit_num_words`` turns a token target into a word count
for the prefix-stable word streams of ``workloads``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Awaitable, Callable, Protocol

from lmi_cache.bench.client import BenchError, OpenAiClient
from lmi_cache.bench.workloads import APPROX_TOKENS_PER_WORD


class TokenCounter(Protocol):
    source: str

    async def count(self, text: str) -> int: ...


class ServerTokenCounter:
    """Counts with the served model's tokenizer through ``/tokenize``."""

    source = "server"

    def __init__(self, client: OpenAiClient) -> None:
        self._client = client

    async def count(self, text: str) -> int:
        count = await self._client.count_tokens(text)
        if count is None:
            raise BenchError(f"{self._client.base_url}/tokenize disappeared during the run")
        return count


class LocalTokenCounter:
    """Counts with a tokenizer on disk (the ``tokenizers`` library, lazily imported)."""

    source = "local"

    def __init__(self, path: str) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise BenchError(f"--tokenizer {path}: no tokenizer.json there; pass a folder or file that has one")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise BenchError("--tokenizer needs the 'tokenizers' package; pip install tokenizers") from None
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as err:  # the library raises a bare Exception on bad files
            raise BenchError(f"--tokenizer {file}: cannot load it ({' '.join(str(err).split())})") from None

    async def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


class ApproxTokenCounter:
    """No tokenizer at hand: assume a fixed number of tokens per word."""

    source = "approx"

    async def count(self, text: str) -> int:
        return math.ceil(len(text.split()) * APPROX_TOKENS_PER_WORD)


async def pick_token_counter(client: OpenAiClient, tokenizer_path: str | None) -> TokenCounter:
    """A local tokenizer if given, else the server's ``/tokenize`` if it has one, else approximate."""
    if tokenizer_path:
        return LocalTokenCounter(tokenizer_path)
    if await client.count_tokens("probe") is not None:
        return ServerTokenCounter(client)
    return ApproxTokenCounter()


async def fit_num_words(
    target_tokens: int,
    text_for: Callable[[int], str],
    count: Callable[[str], Awaitable[int]],
    *,
    max_steps: int = 8,
) -> tuple[int, int]:
    """Words of ``text_for`` giving ``target_tokens`` tokens, or just under: ``(words, tokens)``.

    Secant steps on the tokens-per-word ratio, then single words; never
    returns more tokens than asked unless one word already exceeds it.
    """
    if target_tokens < 1:
        raise ValueError(f"target_tokens must be >= 1, got {target_tokens}")
    tolerance_tokens = max(1, target_tokens // 500)
    num_words = max(1, round(target_tokens / APPROX_TOKENS_PER_WORD))
    best: tuple[int, int] | None = None  # largest (words, tokens) with tokens <= target
    smallest_over: int | None = None
    for _ in range(max_steps):
        num_tokens = await count(text_for(num_words))
        if num_tokens <= target_tokens:
            if best is None or num_words > best[0]:
                best = (num_words, num_tokens)
            if target_tokens - num_tokens < tolerance_tokens:
                return best
        elif smallest_over is None or num_words < smallest_over:
            smallest_over = num_words
        proposal = max(1, round(num_words * target_tokens / max(num_tokens, 1)))
        if proposal == num_words:
            proposal = num_words + (1 if num_tokens < target_tokens else -1)
        if smallest_over is not None and proposal >= smallest_over:
            proposal = smallest_over - 1
        if best is not None and proposal <= best[0]:
            proposal = best[0] + 1
        if proposal < 1 or (smallest_over is not None and proposal >= smallest_over):
            break
        num_words = proposal
    if best is not None:
        return best
    return 1, await count(text_for(1))
