"""Which blended tokens to recompute: KV deviation scores and top-k (or random) selection.

Pure torch; runs at a check layer of the blender (reference or in vLLM). A
token whose freshly computed K (or K and V) at the check layer deviates most
from its cached, re-rotated K is the one whose cached KV missed the most
cross-segment attention, so it is recomputed through the remaining layers.
Random selection of the same count is the baseline that top-k must beat.

A single check layer is run as the published algorithm's gradual filtering
(``gradual_schedule``): the check layer keeps twice the requested count, the
next layer re-measures those and keeps 1.5 times it, the one after keeps the
count. The K deviation at one layer predicts the later layers' only loosely;
re-measuring among the tokens already recomputed narrows the set to the ones
that keep deviating. It carries 1.5 times the count more token-layers through
attention and MLP than one check keeping the count (3% more blend time on an
8-layer model); the same
extra work spent on a larger count instead buys far less
(``docs/blending-quality.md``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

# Multiples of the requested count kept at the check layer and the layers after it (the last is the count).
GRADUAL_STEPS = (2.0, 1.5, 1.0)


def kv_deviation(
    k_fresh: torch.Tensor,
    k_cached: torch.Tensor,
    v_fresh: torch.Tensor | None = None,
    v_cached: torch.Tensor | None = None,
) -> torch.Tensor:
    """Squared L2 distance per token [T] between fresh and cached K (plus V when both are given).

    Inputs are [T, kv_heads, head_dim]; the sum runs in float32 whatever the cache dtype.
    """
    diff = (k_fresh.to(torch.float32) - k_cached.to(torch.float32)).pow(2).flatten(1).sum(dim=1)
    if v_fresh is not None and v_cached is not None:
        diff = diff + (v_fresh.to(torch.float32) - v_cached.to(torch.float32)).pow(2).flatten(1).sum(dim=1)
    return diff


def select_topk(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest scores, ascending (ties: lower index first)."""
    count = max(0, min(count, scores.numel()))
    if count == scores.numel():
        return torch.arange(count, device=scores.device)
    # A stable descending sort makes ties deterministic (torch.topk's order is not specified).
    order = torch.sort(scores, descending=True, stable=True).indices[:count]
    return torch.sort(order).values


def select_random(num_tokens: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct indices of ``num_tokens``, drawn with ``generator``, ascending."""
    count = max(0, min(count, num_tokens))
    if count == num_tokens:
        return torch.arange(count)
    return torch.sort(torch.randperm(num_tokens, generator=generator)[:count]).values


def gradual_schedule(check_layers: Sequence[int], counts: Sequence[int],
                     num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check layers and counts with one check expanded into gradual filtering (``GRADUAL_STEPS``).

    One check layer ``l`` keeping ``c`` becomes ``l: 2c, l+1: 1.5c, l+2: c``, cut to the model's
    layers (the last one kept always keeps ``c``). Several check layers are the caller's own
    schedule and are returned as given.
    """
    if len(check_layers) != 1:
        return tuple(check_layers), tuple(counts)
    first, count = check_layers[0], counts[0]
    layers = [first + i for i in range(len(GRADUAL_STEPS)) if first + i < num_layers] or [first]
    steps = GRADUAL_STEPS[len(GRADUAL_STEPS) - len(layers):]
    return tuple(layers), tuple(int(count * step) for step in steps)
