"""Paired A/B throughput of two servers on prompts that share nothing (bench process).

On a shared machine, load from other processes drifts over minutes, so two
rounds measured at different times compare the load, not the servers. Here
both servers are up at once and serve the same unique prompts one at a time,
alternating A,B then B,A, so each pair sees the same conditions and drift
cancels. Throughput is prompt tokens over summed request latency.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from lmi_cache.bench.client import CompletionResult, OpenAiClient
from lmi_cache.bench.stats import percentile
from lmi_cache.bench.tokens import ServerTokenCounter
from lmi_cache.bench.runner import fit_document_words, fit_query_words
from lmi_cache.bench.workloads import LongDocQaSpec, long_doc_qa_round


@dataclass(frozen=True)
class PairedThroughput:
    """Prompt tokens per second of A and B over the same prompts, and B/A."""

    num_requests: int
    a_prompt_tokens_per_s: float
    b_prompt_tokens_per_s: float
    median_pair_ratio: float

    @property
    def ratio(self) -> float:
        return self.b_prompt_tokens_per_s / self.a_prompt_tokens_per_s

    def to_dict(self) -> dict[str, float]:
        return {
            "num_requests": self.num_requests,
            "a_prompt_tokens_per_s": self.a_prompt_tokens_per_s,
            "b_prompt_tokens_per_s": self.b_prompt_tokens_per_s,
            "ratio": self.ratio,
            "median_pair_ratio": self.median_pair_ratio,
        }


def throughput(results: list[CompletionResult]) -> float:
    tokens = sum(r.prompt_tokens or 0 for r in results)
    return tokens / sum(r.latency_s for r in results)


async def paired_no_reuse(
    url_a: str,
    url_b: str,
    model: str,
    spec: LongDocQaSpec,
    *,
    pause_s: float = 0.3,
    extra_body: dict[str, object] | None = None,
) -> PairedThroughput:
    """Send each of ``spec``'s warm-up prompts to A and B in turn (ABBA order)."""
    body = dict(extra_body or {})
    async with OpenAiClient(url_a, model, extra_body=body) as a, OpenAiClient(url_b, model, extra_body=body) as b:
        counter = ServerTokenCounter(a)
        words, _ = await fit_document_words(spec, counter)
        query_words = await fit_query_words(spec.seed, spec.query_tokens, counter)
        requests = long_doc_qa_round(spec, "unique", words, query_words)
        # One short unmeasured request each: the first request of a fresh server pays lazy set-up.
        for client in (a, b):
            await client.complete("hello there", 2)
        results: dict[str, list[CompletionResult]] = {"a": [], "b": []}
        for index, request in enumerate(requests):
            order = (("a", a), ("b", b)) if index % 2 == 0 else (("b", b), ("a", a))
            for name, client in order:
                results[name].append(await client.complete(request.prompt, request.max_tokens))
                # Let the other server's OpenMP threads stop spinning before the next request.
                await asyncio.sleep(pause_s)
    pair_ratios = [ra.latency_s / rb.latency_s for ra, rb in zip(results["a"], results["b"])]
    return PairedThroughput(
        num_requests=len(requests),
        a_prompt_tokens_per_s=throughput(results["a"]),
        b_prompt_tokens_per_s=throughput(results["b"]),
        median_pair_ratio=percentile(pair_ratios, 50),
    )
