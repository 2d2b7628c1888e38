"""Rotary position embedding (Llama family) and re-rotation of cached K to new positions.

Runs wherever blending runs (the vLLM worker, the reference blender, tests).
Covers the rotary embeddings of Llama 2/3/3.1+ (``rope_theta``; ``rope_scaling``
types ``default``, ``linear`` and ``llama3``), Qwen2/2.5/3 and Mistral (default
RoPE), in the "rotate half" (GPT-NeoX) layout that Hugging Face and vLLM use for
them. Other types (dynamic NTK, YaRN, LongRoPE, partial rotary) are refused
with a ``BlendConfigError``: their angles are not a fixed function of position,
or their cached K cannot be rotated exactly.

Re-rotation turns a K computed at one position to another by the composition
of the two rotations the model would apply: undo the angle at the old position
and apply the one at the new position, both taken from the same float32 angle
table as the model (``position * inv_freq`` rounded as the model rounds it; a
rotation by the rounded position *difference* would not match). The composed
cos/sin are formed once per token and applied in one pass over every layer and
head, so the result equals K computed at the new positions to float32 rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from lmi_cache.blend.settings import BlendConfigError
from lmi_cache.transfer import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """Everything that decides the rotation angles of one model's attention heads."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "RopeSpec":
        """From a model's ``config.json`` (old ``rope_theta``/``rope_scaling`` or new ``rope_parameters``)."""
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        params: dict[str, Any] = {}
        if isinstance(config.get("rope_parameters"), Mapping):
            params.update(config["rope_parameters"])
        if isinstance(config.get("rope_scaling"), Mapping):
            params.update(config["rope_scaling"])
        theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise BlendConfigError(
                f"config.json: rope type {rope_type!r} cannot be blended (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}); turn enable_blending off for this model"
            )
        if partial != 1.0:
            raise BlendConfigError(
                f"config.json: partial_rotary_factor {partial} cannot be blended; turn enable_blending off"
            )
        if rope_type == "default":
            return cls(head_dim=int(head_dim), theta=theta)
        original = params.get("original_max_position_embeddings", config.get("max_position_embeddings", 8192))
        return cls(
            head_dim=int(head_dim),
            theta=theta,
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
        )

    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies, float32, ``head_dim // 2`` of them."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            return _llama3_inv_freq(inv, self)
        return inv

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, head_dim] for integer ``positions`` of shape [T].

        Looked up in a per-spec table (the same float32 products, so the same values):
        blending rotates every layer's K of every segment, and recomputing the
        trigonometry each time cost more than the blend's matmuls.
        """
        if positions.numel() == 0:
            empty = torch.empty((0, self.head_dim), dtype=dtype, device=positions.device)
            return empty, empty
        cos, sin = _table(self, int(positions.max()) + 1)
        index = positions.to(torch.long).cpu()
        return cos[index].to(device=positions.device, dtype=dtype), sin[index].to(device=positions.device, dtype=dtype)


_TABLES: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]] = {}
_TABLE_MIN_POSITIONS = 4096


def _table(spec: RopeSpec, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin [P, head_dim] for positions 0..P-1, P >= ``num_positions`` (grown by doubling)."""
    table = _TABLES.get(spec)
    if table is None or table[0].shape[0] < num_positions:
        size = max(_TABLE_MIN_POSITIONS, num_positions, 2 * (table[0].shape[0] if table is not None else 0))
        angles = torch.arange(size).to(torch.float32)[:, None] * spec.inv_freq()[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        table = (angles.cos(), angles.sin())
        _TABLES[spec] = table
    return table


def _llama3_inv_freq(inv: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    wavelen = 2 * math.pi / inv
    low_freq_wavelen = spec.original_max_position_embeddings / spec.low_freq_factor
    high_freq_wavelen = spec.original_max_position_embeddings / spec.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv / spec.factor, inv)
    ramp = (spec.original_max_position_embeddings / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - ramp) * scaled / spec.factor + ramp * scaled
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, smoothed, scaled)


def _half_cos_sin(spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [T, head_dim // 2] at ``positions`` (the table's two halves are the same angles)."""
    cos, sin = spec.cos_sin(positions)
    half = spec.head_dim // 2
    return cos[:, :half], sin[:, :half]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = x [..., T, heads, D] turned per (i, i + D/2) pair by the angles of ``cos``/``sin`` [T, D/2].

    Two multiply(-add) passes per half written straight into ``out`` (which may be a view):
    the rotate-half form (x * cos + rotate_half(x) * sin) with no temporaries.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_lo, x_hi = x[..., :half], x[..., half:]
    if torch.is_grad_enabled() and x.requires_grad:  # out= ops do not record gradients
        return out.copy_(torch.cat((x_lo * cos - x_hi * sin, x_hi * cos + x_lo * sin), dim=-1))
    out_lo, out_hi = out[..., :half], out[..., half:]
    torch.mul(x_lo, cos, out=out_lo)
    out_lo.addcmul_(x_hi, sin, value=-1)
    torch.mul(x_hi, cos, out=out_hi)
    out_hi.addcmul_(x_lo, sin)
    return out


def _native_rotation(k: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the native one-pass rotation takes these tensors: CPU, 3 or 4 dims, contiguous head rows."""
    if not (k.device.type == "cpu" and out.device.type == "cpu" and k.dim() in (3, 4) and kernels.native_blend_ops()):
        return False
    if torch.is_grad_enabled() and k.requires_grad:
        return False
    for t in (k, out):
        if t.stride(-1) != 1 or (t.shape[-2] > 1 and t.stride(-2) != t.shape[-1]):
            return False
    return True


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate ``x`` of shape [T, heads, head_dim] to ``positions`` [T]."""
    cos, sin = _half_cos_sin(spec, positions)
    return _rotate(x, cos.to(x.dtype), sin.to(x.dtype), torch.empty_like(x))


def rerotate(
    k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor, spec: RopeSpec,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cached K [..., T, kv_heads, head_dim] computed at ``from_positions`` [T], moved to ``to_positions``.

    Leading dims (e.g. layers) share the positions. Computed in float32 and returned in ``k``'s dtype
    (bf16/fp16 caches round once, not twice), into ``out`` when given (same shape; may be a view).
    """
    if torch.equal(from_positions, to_positions):
        return k if out is None else out.copy_(k)  # keeps a segment cached at its own place bit for bit
    cos_old, sin_old = _half_cos_sin(spec, from_positions)
    cos_new, sin_new = _half_cos_sin(spec, to_positions)
    # Rotation by (new - old) composed from the two tabled rotations, in float32.
    cos = cos_new * cos_old + sin_new * sin_old
    sin = sin_new * cos_old - cos_new * sin_old
    if out is None:
        out = torch.empty_like(k)
    if k.dtype == torch.float32 and out.dtype == torch.float32:
        if _native_rotation(k, out):  # one pass instead of four (a sixth of a blend on the RAG benchmark)
            kernels.rotate_pairs(k.view(-1, *k.shape[-3:]), cos.contiguous(), sin.contiguous(),
                                 out.view(-1, *out.shape[-3:]))
            return out
        return _rotate(k, cos, sin, out)
    return out.copy_(_rotate(k.to(torch.float32), cos, sin, torch.empty(k.shape, dtype=torch.float32, device=k.device)))
