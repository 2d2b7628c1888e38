"""Measuring blending quality: next-token distributions of blended vs full prefill, on CPU.

Runs in the quality benchmark, the recall training script and the tests. A
``BlendCase`` is one prompt cut into [prefix | segments | tail]; each
``Condition`` is one way of building the KV before the tail (full prefill,
prefix-only caching, naive concatenation of cached segments, blending at a
ratio with top-k or random selection). ``run_conditions`` returns the tail's
next-token logits under every condition, computed from the same cached
segment KV, so the figures compare like with like.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from lmi_cache.blend.blender import KVStack, LayerwiseModel, blend, naive_concat, prefill, segment_kv


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
                    selection=cond.selection, generator=generator,
                ).kv
            out[cond.name] = _tail_logits(model, context, case.tail)
    return out


def _tail_logits(model: LayerwiseModel, context: KVStack, tail: torch.Tensor) -> torch.Tensor:
    _, hidden = prefill(model, tail, context)
    return model.logits(hidden)


@dataclass
class QualityTally:
    """Running sums of KL(full || condition), greedy agreement and answer accuracy per condition."""

    kl_sum: dict[str, float] = field(default_factory=dict)
    agree_sum: dict[str, float] = field(default_factory=dict)
    correct: dict[str, int] = field(default_factory=dict)
    positions: int = 0
    prompts: int = 0

    def add(self, logits: dict[str, torch.Tensor], reference: str = "full prefill", answer: int | None = None) -> None:
        ref = torch.log_softmax(logits[reference].double(), dim=-1)
        self.positions += ref.shape[0]
        self.prompts += 1
        for name, lg in logits.items():
            logp = torch.log_softmax(lg.double(), dim=-1)
            kl = (ref.exp() * (ref - logp)).sum(dim=-1).clamp_min(0.0)
            self.kl_sum[name] = self.kl_sum.get(name, 0.0) + float(kl.sum())
            agree = (lg.argmax(dim=-1) == logits[reference].argmax(dim=-1)).double().sum()
            self.agree_sum[name] = self.agree_sum.get(name, 0.0) + float(agree)
            if answer is not None:
                self.correct[name] = self.correct.get(name, 0) + int(int(lg[-1].argmax()) == answer)

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
