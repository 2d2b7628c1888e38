"""Runs benchmark rounds against a server and collects their stats (bench process).

A round sends its requests with at most ``concurrency`` in flight and ends when
the last answer has streamed in; its latency is that wall time. Long-document
QA is a warm-up round then a query round over the same documents; multi-round
chat is ``num_rounds`` rounds in which each user's history grows by the
previous answer and a new question.
"""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lmi_cache.bench.client import CompletionResult, OpenAiClient
from lmi_cache.bench.stats import RoundStats, ratio, round_stats
from lmi_cache.bench.tokens import TokenCounter, fit_num_words
from lmi_cache.bench.workloads import (
    LongDocQaSpec,
    MultiRoundChatSpec,
    PromptRequest,
    chat_context_key,
    chat_history_after,
    chat_opening,
    chat_round,
    document_text,
    long_doc_qa_round,
    question_key,
    random_words,
)


@dataclass(frozen=True)
class RequestRecord:
    """One request's outcome; ``start_s`` is relative to its round's start."""

    request_id: str
    start_s: float
    result: CompletionResult

    def to_dict(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "start_s": self.start_s,
            "ttft_s": self.result.ttft_s,
            "latency_s": self.result.latency_s,
            "prompt_tokens": self.result.prompt_tokens,
            "completion_tokens": self.result.completion_tokens,
        }


@dataclass
class RoundResult:
    stats: RoundStats
    records: list[RequestRecord]


@dataclass
class BenchResult:
    """Everything a run measured, ready for ``report``."""

    workload: str
    settings: dict[str, object]
    rounds: list[RoundResult] = field(default_factory=list)

    def round(self, name: str) -> RoundStats | None:
        for item in self.rounds:
            if item.stats.name == name:
                return item.stats
        return None

    def ratios(self) -> dict[str, float | None]:
        """Query over warm-up (long-doc QA) or last over first round (chat)."""
        if len(self.rounds) < 2:
            return {}
        first, last = self.rounds[0].stats, self.rounds[-1].stats
        return {
            "ttft_mean": ratio(last.ttft_s.mean, first.ttft_s.mean),
            "ttft_p50": ratio(last.ttft_s.p50, first.ttft_s.p50),
            "round_latency": ratio(last.round_latency_s, first.round_latency_s),
        }


async def run_round(
    client: OpenAiClient, name: str, requests: Sequence[PromptRequest], concurrency: int
) -> RoundResult:
    """Send ``requests`` with at most ``concurrency`` in flight; records keep request order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)
    round_started = time.perf_counter()

    async def one(request: PromptRequest) -> RequestRecord:
        async with gate:
            start_s = time.perf_counter() - round_started
            result = await client.complete(request.prompt, request.max_tokens)
            return RequestRecord(request.request_id, start_s, result)

    tasks = [asyncio.ensure_future(one(request)) for request in requests]
    try:
        records = list(await asyncio.gather(*tasks))
    except BaseException:
        # One failure ends the run: don't leave the other requests streaming.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    round_latency_s = time.perf_counter() - round_started
    stats = round_stats(
        name,
        [r.result.ttft_s for r in records],
        [r.result.latency_s for r in records],
        round_latency_s,
        [r.result.prompt_tokens for r in records],
        [r.result.completion_tokens for r in records],
    )
    return RoundResult(stats, records)


async def fit_document_words(spec: LongDocQaSpec, counter: TokenCounter) -> tuple[list[int], list[int]]:
    """Word and token counts of each document, fitted to ``spec.document_tokens``."""
    words, tokens = [], []
    for index in range(spec.num_documents):
        num_words, num_tokens = await fit_num_words(
            spec.document_tokens, functools.partial(document_text, spec.seed, index), counter.count
        )
        words.append(num_words)
        tokens.append(num_tokens)
    return words, tokens


async def fit_query_words(seed: int, query_tokens: int, counter: TokenCounter) -> int:
    num_words, _ = await fit_num_words(
        query_tokens, lambda n: random_words(question_key(seed, "fit", 0), n), counter.count
    )
    return num_words


async def run_long_doc_qa(
    client: OpenAiClient,
    spec: LongDocQaSpec,
    counter: TokenCounter,
    concurrency: int,
    *,
    round_names: Sequence[str] = ("warmup", "query"),
    before_round: Callable[[str], None] | None = None,
) -> BenchResult:
    """Warm-up round (each document with a question), then the query round.

    ``before_round(name)`` runs before each round (between rounds nothing is in flight).
    """
    document_words, document_tokens = await fit_document_words(spec, counter)
    query_words = await fit_query_words(spec.seed, spec.query_tokens, counter)
    result = BenchResult(
        workload="long-doc-qa",
        settings={
            "model": client.model,
            "num_documents": spec.num_documents,
            "document_tokens": spec.document_tokens,
            "measured_document_tokens": document_tokens,
            "token_count_source": counter.source,
            "query_tokens": spec.query_tokens,
            "output_tokens": spec.output_tokens,
            "concurrency": concurrency,
            "seed": spec.seed,
        },
    )
    for name in round_names:
        if before_round is not None:
            before_round(name)
        requests = long_doc_qa_round(spec, name, document_words, query_words)
        result.rounds.append(await run_round(client, name, requests, concurrency))
    return result


async def run_multi_round_chat(
    client: OpenAiClient, spec: MultiRoundChatSpec, counter: TokenCounter, concurrency: int
) -> BenchResult:
    """Rounds of one turn per user; each history grows by the answer and the next question."""
    histories = []
    context_tokens = []
    for user in range(spec.num_users):
        num_words, num_tokens = await fit_num_words(
            spec.context_tokens, functools.partial(random_words, chat_context_key(spec.seed, user)), counter.count
        )
        histories.append(chat_opening(spec, user, num_words))
        context_tokens.append(num_tokens)
    query_words = await fit_query_words(spec.seed, spec.query_tokens, counter)
    result = BenchResult(
        workload="multi-round-chat",
        settings={
            "model": client.model,
            "num_users": spec.num_users,
            "num_rounds": spec.num_rounds,
            "context_tokens": spec.context_tokens,
            "measured_context_tokens": context_tokens,
            "token_count_source": counter.source,
            "query_tokens": spec.query_tokens,
            "output_tokens": spec.output_tokens,
            "concurrency": concurrency,
            "seed": spec.seed,
        },
    )
    for round_index in range(spec.num_rounds):
        requests = chat_round(spec, round_index, histories, query_words)
        outcome = await run_round(client, f"round{round_index}", requests, concurrency)
        result.rounds.append(outcome)
        histories = [
            chat_history_after(request.prompt, record.result.text)
            for request, record in zip(requests, outcome.records)
        ]
    return result
