"""The planner's blending step: is the model covered, and the plan line that says what blending does.

Pure (container start: ``plan`` / ``configure`` / ``serve``; torch-free). The
vLLM arguments follow ``ServingSettings.blend_connector``; this step refuses a
model the blender does not cover before anything is written or started (one
line naming the option and the model type, as the worker would at start, but
before the model is downloaded or loaded) and explains the choice.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autoconfig.plan.types import PlanError

if TYPE_CHECKING:
    from autoconfig.plan.types import PlanModel
    from autoconfig.plan.settings import ServingSettings
    from lmi_cache.blend.settings import BlendSettings


def blend_model_problem(blend: BlendSettings, config: Mapping[str, Any] | None, name: str,
                        num_layers: int | None) -> tuple[str, str] | None:
    """Why ``blend`` cannot run on this model: (the key to change, one line), or None.

    ``enable_blending``: the model type is not covered (the line says what, without where
    blending was turned on); ``blend_check_layers``: a check layer past the model's layers.
    """
    from lmi_cache.blend.settings import BlendConfigError
    from lmi_cache.blend.support import blend_refusal

    reason = blend_refusal(config, name or "the model") if config is not None else None
    if reason is not None:
        return "enable_blending", f"{reason}; turn blending off for this model"
    if num_layers is not None:
        try:
            blend.check_model(num_layers, name or "the model")
        except BlendConfigError as err:
            return "blend_check_layers", str(err)
    return None


def check_blend_model(s: ServingSettings, config: Mapping[str, Any] | None, name: str,
                      num_layers: int | None = None) -> None:
    """PlanError when blending is wired and the model (its config.json) cannot be blended."""
    if not s.blend_connector or config is None:
        return
    problem = blend_model_problem(s.blend, config, name, num_layers)
    if problem is not None:
        key, line = problem
        raise PlanError(f"{s.blend_where}: {line}" if key == "enable_blending" else line)


def plan_blending(m: PlanModel, s: ServingSettings, why: list[str], warn: list[str]) -> BlendSettings | None:
    """The blending the server runs (None: off, or upstream LMCache's own), with its line in ``why``."""
    b = s.blend
    if not b.enabled:
        return None
    if not s.blend_connector:
        line = (f"enable_blending = true ({s.blend_where}): read by upstream LMCache itself "
                "(option.lmcache_engine=lmcache); lmi-cache neither wires nor checks upstream's blender")
        why.append(line)
        warn.append(line)
        return None
    check_blend_model(s, m.config, m.name, m.layout.num_layers)
    covered = (f"model_type {m.config.get('model_type')!r} is covered" if m.config is not None
               else "the model type is checked when the server starts")
    why.append(
        f"blending = on ({s.blend_where}): LmiCacheConnector blends (enable_blending in the YAML). Each prompt "
        f"segment that ends in blend_special_str {b.special_str!r} is stored on its own and reused wherever it "
        f"appears again; {_ratios(b)} of its tokens are recomputed after check layer(s) "
        f"{list(b.check_layers)}; only requests with >= {b.min_tokens} tokens from cached segments are blended; "
        f"{covered}. Segment KV takes room in the same tiers as prefix chunks")
    return b


def _ratios(b: BlendSettings) -> str:
    return " then ".join(f"{r:.0%}" for r in b.recompute_ratios)
