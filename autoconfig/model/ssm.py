"""A hybrid model's config.json -> its Mamba / linear-attention state geometry, as vLLM 0.32 allocates it.

Run by autoconfig in the container-start process (``plan``, ``configure``,
``serve``) before vLLM starts: JSON only, no torch. Hybrid models (Qwen3-Next,
Granite 4 hybrid, Jamba, ...) mix attention layers, which keep KV per token,
with state layers, which keep one fixed-size state per request (a short
convolution window and a recurrent "SSM" state). vLLM stores that state in
its own KV cache groups (``MambaSpec``); each rule below names the vLLM code
it mirrors (``vllm/model_executor/layers/mamba/mamba_utils.py``
``MambaStateShapeCalculator`` and the model classes'
``get_mamba_state_shape_from_config``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from lmi_cache.errors import UserError
from lmi_cache.kv_layout import KV_DTYPE_BYTES

__all__ = ["HybridModelError", "StateLayout", "attention_layer_indices", "refuse_state_caching",
           "state_layout_from_config"]


class HybridModelError(UserError):
    """A hybrid attention / state-space model that lmi-cache cannot size or cache (names why)."""


@dataclass(frozen=True)
class StateLayout:
    """Per-request state of a hybrid model's state layers (the whole model, before the TP split).

    ``kind`` names vLLM's state calculator: "gated_delta_net" (Qwen3-Next), "mamba2"
    (Granite 4 hybrid), "mamba1" (Jamba). Shapes follow vLLM's default "SD" conv layout.
    """

    kind: str
    num_state_layers: int
    num_attention_layers: int
    conv_dim: int  # channels of the convolution window besides Mamba2's B/C groups (before TP)
    conv_window: int  # tokens the convolution keeps: conv kernel - 1
    ssm_heads: int  # leading, TP-split dimension of the recurrent state
    ssm_inner: tuple[int, ...]  # the recurrent state's other dimensions (not split)
    state_dtype: str  # conv and SSM state dtype (vLLM's mamba_cache_dtype "auto": the model dtype)
    num_groups: int = 0  # Mamba2's n_groups (B and C each have num_groups x group_channels channels)
    group_channels: int = 0

    def conv_shape(self, tp: int = 1) -> tuple[int, int]:
        """(window, channels) of one layer's conv state on one rank (vLLM's "SD" layout).

        Mamba2 pads n_groups up to tp when tp does not divide it, so each rank holds the groups its heads
        read (MambaStateShapeCalculator.extra_groups_for_head_shards).
        """
        groups = self.num_groups if self.num_groups % tp == 0 else self.num_groups + tp - self.num_groups
        return (self.conv_window, (self.conv_dim + 2 * groups * self.group_channels) // tp)

    def ssm_shape(self, tp: int = 1) -> tuple[int, ...]:
        return (self.ssm_heads // tp, *self.ssm_inner)

    def layer_state_bytes(self, tp: int = 1) -> int:
        """Bytes of one layer's state for one request on one rank: vLLM's MambaSpec page before padding."""
        elements = math.prod(self.conv_shape(tp)) + math.prod(self.ssm_shape(tp))
        return elements * KV_DTYPE_BYTES[self.state_dtype]

    def request_state_bytes(self, tp: int = 1) -> int:
        """One request's state over every state layer, on one rank: what a cached chunk boundary holds."""
        return self.num_state_layers * self.layer_state_bytes(tp)

    def describe(self, tp: int = 1) -> str:
        return (f"{self.kind} state per layer = conv {self.conv_shape(tp)} + ssm {self.ssm_shape(tp)} x "
                f"{KV_DTYPE_BYTES[self.state_dtype]} B ({self.state_dtype}) = {self.layer_state_bytes(tp):,} B")


def attention_layer_indices(text: Mapping[str, Any], model_type: str, num_layers: int) -> list[int] | None:
    """Which layers are attention layers in a hybrid model; None when the config is not a known hybrid."""
    kinds = text.get("layer_types") or text.get("layers_block_type")
    if model_type in ("qwen3_next", "granitemoehybrid") and isinstance(kinds, list):
        return [i for i, k in enumerate(kinds) if str(k) in ("full_attention", "attention")]
    if model_type == "qwen3_next":
        # transformers' Qwen3NextConfig: every full_attention_interval-th layer is full attention.
        interval = int(text.get("full_attention_interval") or 4)
        return [i for i in range(num_layers) if (i + 1) % interval == 0]
    if model_type == "jamba":
        # vLLM jamba.py: layer i is attention when i % attn_layer_period == attn_layer_offset.
        period, offset = int(text.get("attn_layer_period", 8)), int(text.get("attn_layer_offset", 4))
        return [i for i in range(num_layers) if i % period == offset]
    return None


def _int(text: Mapping[str, Any], key: str, prefix: str, source: str, default: int | None = None) -> int:
    value = text.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HybridModelError(f"{source}: '{prefix}{key}' must be a positive integer for this hybrid model, "
                               f"got {value!r}; fix the config.json")
    return value


_Shape = tuple[int, int, int, tuple[int, ...], int, int]  # conv_dim, window, heads, inner, groups, group channels


def _gated_delta_net(text: Mapping[str, Any], p: str, src: str) -> _Shape:
    # vLLM qwen3_next.py -> MambaStateShapeCalculator.gated_delta_net_state_shape.
    k_heads, v_heads = _int(text, "linear_num_key_heads", p, src), _int(text, "linear_num_value_heads", p, src)
    k_dim, v_dim = _int(text, "linear_key_head_dim", p, src), _int(text, "linear_value_head_dim", p, src)
    kernel = _int(text, "linear_conv_kernel_dim", p, src)
    return 2 * k_heads * k_dim + v_heads * v_dim, kernel - 1, v_heads, (v_dim, k_dim), 0, 0


def _mamba2(text: Mapping[str, Any], p: str, src: str) -> _Shape:
    # vLLM granitemoehybrid.py -> MambaStateShapeCalculator.mamba2_state_shape.
    hidden, expand = _int(text, "hidden_size", p, src), _int(text, "mamba_expand", p, src, 2)
    heads, groups = _int(text, "mamba_n_heads", p, src), _int(text, "mamba_n_groups", p, src, 1)
    state, kernel = _int(text, "mamba_d_state", p, src), _int(text, "mamba_d_conv", p, src, 4)
    inner = expand * hidden
    head_dim = text.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else _int(text, "mamba_d_head", p, src)
    return inner, kernel - 1, heads, (head_dim, state), groups, state


def _mamba1(text: Mapping[str, Any], p: str, src: str) -> _Shape:
    # vLLM jamba.py -> MambaStateShapeCalculator.mamba1_state_shape.
    inner = _int(text, "mamba_expand", p, src, 2) * _int(text, "hidden_size", p, src)
    state, kernel = _int(text, "mamba_d_state", p, src, 16), _int(text, "mamba_d_conv", p, src, 4)
    return inner, kernel - 1, inner, (state,), 0, 0


_KINDS: dict[str, tuple[str, Callable[[Mapping[str, Any], str, str], _Shape]]] = {
    "qwen3_next": ("gated_delta_net", _gated_delta_net),
    "granitemoehybrid": ("mamba2", _mamba2),
    "jamba": ("mamba1", _mamba1),
}


def state_layout_from_config(text: Mapping[str, Any], prefix: str, model_type: str, num_layers: int,
                             state_dtype: str, source: str) -> StateLayout:
    """The state geometry of a hybrid model whose kind lmi-cache knows; HybridModelError (one line) otherwise."""
    attention = attention_layer_indices(text, model_type, num_layers)
    if model_type not in _KINDS or attention is None:
        raise HybridModelError(
            f"{source}: model_type '{model_type}' mixes attention with state-space / linear-attention layers whose "
            "state lmi-cache cannot size yet (it knows qwen3_next, granitemoehybrid and jamba): serve it without "
            "KV offloading"
        )
    kind, shape = _KINDS[model_type]
    conv_dim, window, heads, inner, groups, group_channels = shape(text, prefix, source)
    if not attention or len(attention) == num_layers:
        raise HybridModelError(f"{source}: '{prefix}layer_types' gives {len(attention)} attention layers of "
                               f"{num_layers}; a hybrid model needs both kinds: fix the config.json")
    return StateLayout(kind=kind, num_state_layers=num_layers - len(attention), num_attention_layers=len(attention),
                       conv_dim=conv_dim, conv_window=window, ssm_heads=heads, ssm_inner=inner,
                       state_dtype=state_dtype, num_groups=groups, group_channels=group_channels)


def refuse_state_caching(state: StateLayout, model: str) -> None:
    """Auto-configuration's one-line refusal of a hybrid model for upstream LMCache (option.lmcache_engine=lmcache).

    The planner sizes these models (``autoconfig.plan.hybrid``) for lmi-cache's own connector, which stores
    the state at chunk boundaries; the upstream connector is not wired or checked for them here.
    """
    layers = state.num_attention_layers + state.num_state_layers
    raise HybridModelError(
        f"{model}: {state.num_state_layers} of {layers} layers keep a per-request {state.kind} state "
        f"({state.request_state_bytes():,} B per request), which lmi-cache configures for its own connector only: "
        "set option.lmcache_engine=lmi_cache, or serve this model without KV offloading "
        "(option.lmcache_auto_config=false)"
    )
