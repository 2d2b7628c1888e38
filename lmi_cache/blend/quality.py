"""Measuring blending quality: next-token distributions of blended vs full prefill, on CPU.

Runs in the quality benchmark, the recall training script and the tests. A
``BlendCase`` is one prompt cut into [prefix | segments | tail]; each
``Condition`` is one way of building the KV before the tail (full prefill,
prefix-only caching, naive concatenation of cached segments, blending at a
ratio with top-k or random selection). ``run_conditions`` returns the tail's
next-token logits under every condition, computed from the same cached
segment KV, so the figures compare like with like. ``QualityTally`` also
keeps each prompt's figures, so two conditions (top-k against random
selection of as many tokens) can be compared prompt by prompt.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from lmi_cache.blend.attention import SegmentAttention, attend_with_lse
from lmi_cache.blend.blender import (
    KVStack,
    LayerwiseModel,
    blend,
    naive_concat,
    prefill,
    segment_kv,
)
from lmi_cache.blend.layer0_reuse import segment_kv_and_attention


@dataclass(frozen=True)
class BlendCase:
    """One prompt: exact prefix, blended segments, tail (prefilled over the result)."""

    prefix: torch.Tensor
    segments: tuple[torch.Tensor, ...]
    tail: torch.Tensor

    @property
    def num_blended_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.segments)


@dataclass(frozen=True)
class Condition:
    """How the context KV is built; ``ratio`` and ``selection`` only for kind "blend"."""

    name: str
    kind: Literal["full", "prefix", "naive", "blend"]
    ratio: float = 0.0
    selection: Literal["topk", "random"] = "topk"
    deviation: Literal["k", "kv"] = "k"
    gradual: bool = True  # False: one check keeping the count (``blender.blend``'s ``gradual``)
    layer0_merge: bool = False  # layer 0 from each segment's stored attention, as the vLLM worker's native path


def standard_conditions(ratios: Sequence[float], random_ratios: Sequence[float] = ()) -> list[Condition]:
    conds = [Condition("full prefill", "full"), Condition("prefix-only caching", "prefix"),
             Condition("naive concatenation", "naive")]
    conds += [Condition(f"blend {r:g}", "blend", r) for r in ratios]
    conds += [Condition(f"random {r:g}", "blend", r, "random") for r in random_ratios]
    return conds


def run_conditions(
    model: LayerwiseModel,
    case: BlendCase,
    conditions: Sequence[Condition],
    check_layers: Sequence[int] = (1,),
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Tail logits [tail_len, vocab] for each condition's name."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        prefix_kv, _ = prefill(model, case.prefix)
        cached = [segment_kv(model, s) for s in case.segments]
        within: list[SegmentAttention | None] | None = None
        if any(c.layer0_merge for c in conditions):
            within = [segment_kv_and_attention(model, s, None, _attend_with_lse)[1] for s in case.segments]
        body = torch.cat(list(case.segments))
        for cond in conditions:
            if cond.kind == "full":
                _, hidden = prefill(model, torch.cat((case.prefix, body, case.tail)))
                out[cond.name] = model.logits(hidden[-case.tail.numel():])
                continue
            if cond.kind == "prefix":
                body_kv, _ = prefill(model, body, prefix_kv)
                context = prefix_kv.cat(body_kv)
            elif cond.kind == "naive":
                context = naive_concat(model, prefix_kv, cached)
            else:
                count = math.floor(cond.ratio * case.num_blended_tokens + 1e-9)
                generator = torch.Generator().manual_seed(seed)
                context = blend(
                    model, prefix_kv, case.segments, cached, check_layers, [count] * len(check_layers),
                    selection=cond.selection, deviation=cond.deviation, generator=generator, gradual=cond.gradual,
                    layer0_within=within if cond.layer0_merge else None,
                ).kv
            out[cond.name] = _tail_logits(model, context, case.tail)
    return out


def _attend_with_lse(q: torch.Tensor, limits: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return attend_with_lse(q, k, v, limits, scale)


def _tail_logits(model: LayerwiseModel, context: KVStack, tail: torch.Tensor) -> torch.Tensor:
    _, hidden = prefill(model, tail, context)
    return model.logits(hidden)


@dataclass
class QualityTally:
    """Running sums of KL(full || condition), greedy agreement and answer accuracy per condition.

    Also keeps each prompt's KL and answer per condition, for paired comparisons of two conditions.
    """

    kl_sum: dict[str, float] = field(default_factory=dict)
    agree_sum: dict[str, float] = field(default_factory=dict)
    correct: dict[str, int] = field(default_factory=dict)
    positions: int = 0
    prompts: int = 0
    prompt_kl: dict[str, list[float]] = field(default_factory=dict)
    prompt_correct: dict[str, list[bool]] = field(default_factory=dict)

    def add(self, logits: dict[str, torch.Tensor], reference: str = "full prefill", answer: int | None = None) -> None:
        ref = torch.log_softmax(logits[reference].double(), dim=-1)
        self.positions += ref.shape[0]
        self.prompts += 1
        for name, lg in logits.items():
            logp = torch.log_softmax(lg.double(), dim=-1)
            kl = (ref.exp() * (ref - logp)).sum(dim=-1).clamp_min(0.0)
            self.kl_sum[name] = self.kl_sum.get(name, 0.0) + float(kl.sum())
            self.prompt_kl.setdefault(name, []).append(float(kl.mean()))
            agree = (lg.argmax(dim=-1) == logits[reference].argmax(dim=-1)).double().sum()
            self.agree_sum[name] = self.agree_sum.get(name, 0.0) + float(agree)
            if answer is not None:
                right = int(lg[-1].argmax()) == answer
                self.correct[name] = self.correct.get(name, 0) + int(right)
                self.prompt_correct.setdefault(name, []).append(right)

    def compare(self, a: str, b: str, resamples: int = 2000, seed: int = 0) -> PairedComparison:
        """Condition ``a`` against ``b`` on the same prompts: per-prompt wins and losses, sign tests, bootstrap CI."""
        kl_a, kl_b = self.prompt_kl[a], self.prompt_kl[b]
        right_a, right_b = self.prompt_correct.get(a, []), self.prompt_correct.get(b, [])
        a_only = sum(1 for x, y in zip(right_a, right_b) if x and not y)
        b_only = sum(1 for x, y in zip(right_a, right_b) if y and not x)
        # KL ties (both exact, or the same tokens recomputed) count for neither side.
        kl_lower_a = sum(1 for x, y in zip(kl_a, kl_b) if x < y)
        kl_lower_b = sum(1 for x, y in zip(kl_a, kl_b) if y < x)
        diffs = [float(x) - float(y) for x, y in zip(right_a, right_b)]
        low, high = _bootstrap_mean_ci(diffs, resamples, seed) if diffs else (0.0, 0.0)
        return PairedComparison(
            a=a, b=b, prompts=len(kl_a), a_only_correct=a_only, b_only_correct=b_only,
            accuracy_sign_p=sign_test(a_only, b_only), accuracy_diff_ci95=(low, high),
            a_lower_kl=kl_lower_a, b_lower_kl=kl_lower_b, kl_sign_p=sign_test(kl_lower_a, kl_lower_b),
        )

    def rows(self) -> list[QualityRow]:
        return [
            QualityRow(
                condition=name,
                mean_kl=self.kl_sum[name] / max(1, self.positions),
                greedy_agreement=self.agree_sum[name] / max(1, self.positions),
                accuracy=self.correct.get(name, 0) / max(1, self.prompts) if self.correct else None,
            )
            for name in self.kl_sum
        ]


@dataclass(frozen=True)
class QualityRow:
    """One condition's figures: mean KL(full || condition) per position, greedy agreement, answer accuracy."""

    condition: str
    mean_kl: float
    greedy_agreement: float
    accuracy: float | None = None


@dataclass(frozen=True)
class PairedComparison:
    """Two conditions on the same prompts (e.g. top-k vs random selection of the same number of tokens).

    ``a_only_correct``: prompts that ``a`` answers right and ``b`` wrong (and vice versa); the sign
    tests are two-sided exact binomial tests on those discordant prompts (and on which condition's KL
    to full prefill is lower); ``accuracy_diff_ci95`` is a paired bootstrap interval of acc(a) - acc(b).
    """

    a: str
    b: str
    prompts: int
    a_only_correct: int
    b_only_correct: int
    accuracy_sign_p: float
    accuracy_diff_ci95: tuple[float, float]
    a_lower_kl: int
    b_lower_kl: int
    kl_sign_p: float


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test p-value for ``wins`` vs ``losses`` (ties dropped); 1.0 with none."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def _bootstrap_mean_ci(values: Sequence[float], resamples: int, seed: int) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``values`` (resampled with a seeded RNG)."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * (resamples - 1))], means[int(0.975 * (resamples - 1))]
