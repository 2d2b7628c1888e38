"""Which model the settings name, and its config.json as every check reads it (container start, CLI).

``model_info`` is the one reader the checks, the planner and the host sources
use: an unreadable model is named where the settings set it (file and line,
variable or flag). ``model_here`` lets ``option.model_id=/opt/ml/model`` (the
container's path) plan from ``--model-dir`` on a machine where that path does
not exist.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from autoconfig.lmi.properties import ResolvedProperties
from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from autoconfig.model.source import ModelInfo


def model_info(props: ResolvedProperties, model: str, env: Mapping[str, str], *, typed: bool = True) -> "ModelInfo":
    """config.json of ``model`` as every check reads it; an unreadable model named where the settings set it.

    ``typed``: with the settings' dtype and kv_cache_dtype (False: the geometry alone).
    """
    from autoconfig.model.source import hub_access_from_env, load_model_info

    hf_home, allow_network = hub_access_from_env(env)
    kv_cache_dtype, dtype = (props.settings.kv_cache_dtype, props.settings.dtype) if typed else ("auto", "auto")
    try:
        return load_model_info(model, kv_cache_dtype=kv_cache_dtype, dtype=dtype, hf_home=hf_home,
                               allow_network=allow_network)
    except UserError as err:
        opt = props.options.get("model_id")
        if opt is None or model != props.model_id or str(err).startswith(opt.where):
            raise
        raise type(err)(f"{opt.where}={model}: {str(err).removeprefix(model + ': ')}") from None


def model_here(props: ResolvedProperties, mdir: Path) -> ResolvedProperties:
    """option.model_id naming a path that is not here (the container's /opt/ml/model on a laptop) while the
    model directory holds config.json: the model is that directory, with a note."""
    opt = props.options.get("model_id")
    if opt is None or props.model_id is None or not props.model_id.startswith("/") or Path(props.model_id).exists() \
            or not (mdir / "config.json").is_file():
        return props
    note = (f"{opt.where}={props.model_id} does not exist here; the model is {mdir}, which holds config.json "
            f"(in the container {props.model_id} is where SageMaker puts the model)")
    return replace(props, model_id=str(mdir), notes=[*props.notes, note])
