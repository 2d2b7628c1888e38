"""Paired A/B throughput of two servers on prompts that share nothing (bench process).

On a shared machine, load from other processes drifts over minutes, so two
rounds measured at different times compare the load, not the servers. Here
both servers are up at once and serve the same unique prompts one at a time,
alternating A,B then B,A, so each pair sees the same conditions and drift
cancels. Throughput is prompt tokens over summed request latency.
"""
from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from lmi_cache.bench.client import CompletionResult, OpenAiClient
from lmi_cache.bench.stats import percentile
from lmi_cache.bench.tokens import ServerTokenCounter
from lmi_cache.bench.runner import fit_document_words, fit_query_words
from lmi_cache.bench.workloads import LongDocQaSpec, long_doc_qa_round


@dataclass(frozen=True)
class PairedThroughput:
    """Prompt tokens per second of A and B over the same prompts, and B/A.

    Keeps the sums, so that runs on several server starts merge into one figure
    (the spread between two starts of the same server on this host is larger
    than the difference being measured).
    """

    a_tokens: int
    a_seconds: float
    b_tokens: int
    b_seconds: float
    pair_ratios: tuple[float, ...]  # per prompt: A latency / B latency
    start_ratios: tuple[float, ...] = ()  # per server start: B throughput / A throughput

    @property
    def num_requests(self) -> int:
        return len(self.pair_ratios)

    @property
    def a_prompt_tokens_per_s(self) -> float:
        return self.a_tokens / self.a_seconds

    @property
    def b_prompt_tokens_per_s(self) -> float:
        return self.b_tokens / self.b_seconds

    @property
    def ratio(self) -> float:
        return self.b_prompt_tokens_per_s / self.a_prompt_tokens_per_s

    @property
    def median_pair_ratio(self) -> float:
        return percentile(list(self.pair_ratios), 50)

    @classmethod
    def merged(cls, runs: list[PairedThroughput]) -> PairedThroughput:
        """One figure over runs on separate server starts; ``start_ratios`` keeps each start's ratio."""
        return cls(
            a_tokens=sum(r.a_tokens for r in runs), a_seconds=sum(r.a_seconds for r in runs),
            b_tokens=sum(r.b_tokens for r in runs), b_seconds=sum(r.b_seconds for r in runs),
            pair_ratios=tuple(x for r in runs for x in r.pair_ratios),
            start_ratios=tuple(r.ratio for r in runs),
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "num_requests": self.num_requests,
            "a_prompt_tokens_per_s": self.a_prompt_tokens_per_s,
            "b_prompt_tokens_per_s": self.b_prompt_tokens_per_s,
            "ratio": self.ratio,
            "median_pair_ratio": self.median_pair_ratio,
            "start_ratios": list(self.start_ratios),
        }


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
    return PairedThroughput(
        a_tokens=sum(r.prompt_tokens or 0 for r in results["a"]),
        a_seconds=sum(r.latency_s for r in results["a"]),
        b_tokens=sum(r.prompt_tokens or 0 for r in results["b"]),
        b_seconds=sum(r.latency_s for r in results["b"]),
        pair_ratios=tuple(ra.latency_s / rb.latency_s for ra, rb in zip(results["a"], results["b"])),
    )


def scrape_total(url: str, name: str, timeout_s: float = 10.0) -> float:
    """Sum of every sample of counter ``name`` (``..._total``) on a server's /metrics; 0.0 when absent."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout_s) as response:
        text = response.read().decode("utf-8", errors="replace")
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == f"{name}_total")
