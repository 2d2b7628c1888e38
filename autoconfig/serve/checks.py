"""Checks ``lmi-cache serve`` makes before anything starts (container-start process, before vLLM is imported).

Each raises ``ServeError`` with one line naming the setting and what to do,
or returns the warnings to print: the port, the model location, the parallel
degrees against the GPUs, a user's LMCache YAML against the host, and the
LMCACHE_* variables the server will read.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from autoconfig.lmi.properties import ResolvedProperties
from autoconfig.model.mistral import has_model_config
from autoconfig.model.s3 import is_s3
from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from autoconfig.plan.types import TierPlan
    from autoconfig.probe.snapshot import HostSnapshot

PORT_ENV = "SAGEMAKER_BIND_TO_PORT"
DEFAULT_PORT = 8080


class ServeError(UserError):
    """Settings that cannot be served (names the option and what to do)."""


def server_port(env: Mapping[str, str]) -> int:
    raw = env.get(PORT_ENV, "").strip()
    if not raw:
        return DEFAULT_PORT
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ServeError(f"environment variable {PORT_ENV}={raw!r}: must be a TCP port number (1-65535)")
    return port


def model_argument(props: ResolvedProperties, model_dir: Path) -> str:
    """What vLLM's --model gets: option.model_id (path or hub id) or the model directory itself."""
    if props.model_id is not None:
        if is_s3(props.model_id):
            return props.model_id  # copied from S3 before the start (autoconfig.model.s3)
        candidate = Path(props.model_id)
        if not candidate.is_absolute() and (model_dir / candidate).exists():
            return str(model_dir / candidate)
        return props.model_id
    if has_model_config(model_dir):
        return str(model_dir)
    raise ServeError(f"no model: {model_dir} has no config.json and option.model_id / HF_MODEL_ID is unset; "
                     "set option.model_id or mount the model at --model-dir")


def check_parallelism(props: ResolvedProperties, host: "HostSnapshot") -> None:
    """Replicas x TP x PP must fit the GPUs (the planner checks it in auto mode; this covers the others)."""
    s = props.settings
    if not host.gpus or s.tp * s.pp * s.dp <= len(host.gpus):
        return
    if s.tp * s.pp > len(host.gpus) or s.dp == 1:
        opt = props.options.get("tensor_parallel_degree")
        where = opt.where if opt is not None else "tensor_parallel_degree"
        raise ServeError(f"{where}={s.tp} (x pipeline_parallel_degree={s.pp}) needs {s.tp * s.pp} GPUs but this "
                         f"host has {len(host.gpus)}: lower tensor_parallel_degree or use a larger instance")
    opt = props.options.get("data_parallel_degree")
    where = opt.where if opt is not None else "data_parallel_degree"
    raise ServeError(f"{where}={s.dp} replicas x tp={s.tp} x pp={s.pp} need {s.dp * s.tp * s.pp} GPUs but this "
                     f"host has {len(host.gpus)}: lower data_parallel_degree or use a larger instance")


def check_user_config(
    props: ResolvedProperties, model: str, host: "HostSnapshot", env: Mapping[str, str],
    planned: "TierPlan | None" = None,
) -> tuple[list[str], "TierPlan | None"]:
    """The user's YAML and/or ``LMCACHE_*`` variables as the server reads them, checked against this host.

    ``planned``: auto-configuration's plan, whose YAML ``LMCACHE_<KEY>`` variables override.
    Errors fail (one line, the setting as the user gave it); returns the warnings and the
    tiers that will run (None when config.json cannot be read now).
    """
    from autoconfig.serve.model_access import model_info
    from autoconfig.validate import checked_tiers

    path = props.config_file if planned is None else Path("the planned LMCache YAML")
    if path is not None and planned is None:
        from autoconfig.serve.configure import check_yaml_path

        check_yaml_path(path, props.config_where)
    try:
        info = model_info(props, model, env)
    except UserError as err:
        # The YAML's keys are still checked by configure; only the size checks need config.json.
        return [f"sizes in {path or 'LMCACHE_* variables'} not checked against the host: {err}"], None
    findings, plan = checked_tiers(str(path) if path is not None else None, info, props.settings, host, env=env,
                                   planned=planned.lmcache_config if planned is not None else None)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        command = "lmi-cache validate" + (f" {path}" if props.config_file is not None else " --model-dir DIR")
        more = f" (+{len(errors) - 1} more: run '{command}')" if len(errors) > 1 else ""
        named = errors[0].message.startswith("environment variable") or props.config_file is None
        raise ServeError(f"{'' if named else props.config_where + ': '}{errors[0].message}{more}")
    return [str(f) for f in findings], plan


def lmcache_env_findings(env: Mapping[str, str], cache_on: bool) -> list[str]:
    """LMCACHE_* variables the server will read: checked now (a bad value fails here) and named at start.

    Which of them override the YAML is said once, by configure (names only: values
    can hold credentials).
    """
    from lmi_cache.config.cache_config import CONFIG_FILE_ENV, load_config

    lmcache_env = {k: v for k, v in env.items() if k.startswith("LMCACHE_") and k != CONFIG_FILE_ENV}
    if not cache_on:
        named = sorted(k for k in env if k.startswith("LMCACHE_"))
        if not named:
            return []
        return [f"WARNING {', '.join(named)} set but the cache is off: not read (none of them is an LMCache "
                "setting; turn the cache on with option.lmcache_auto_config=true or option.lmcache_config_file)"]
    if not lmcache_env:
        return []
    _, warnings = load_config(None, lmcache_env)
    return [f"WARNING {w}" for w in warnings]  # overrides are named once, by configure


def check_start(props: ResolvedProperties, model: str, host: "HostSnapshot", env: Mapping[str, str]) -> None:
    """What vLLM will refuse (autoconfig.plan.start_checks), in every cache mode, when config.json can be read now."""
    from autoconfig.plan.start_checks import check_startable
    from autoconfig.serve.model_access import model_info

    try:
        info = model_info(props, model, env)
    except UserError:
        return  # configure reports an unreadable model where it needs one; vLLM does otherwise
    check_startable(info, props.settings, host, env, {n: o.where for n, o in props.options.items()})


def largest_fitting_tp(num_gpus: int, heads: tuple[int, int]) -> int:
    """The largest TP <= ``num_gpus`` vLLM accepts for (attention heads, KV heads).

    vLLM (ModelConfig.verify_with_parallel_config) needs the attention heads
    divisible by TP; KV heads are split when there are at least TP of them
    (divisible) and replicated otherwise (TP a multiple of them).
    """
    attn, kv = heads
    for tp in range(max(1, num_gpus), 0, -1):
        if attn % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0):
            return tp
    return 1


def model_heads(props: ResolvedProperties, model_dir: Path, env: Mapping[str, str]) -> tuple[int, int] | None:
    """(attention heads, KV heads) of the model when its config.json can be read now, else None."""
    from autoconfig.serve.model_access import model_info

    model = props.model_id or (str(model_dir) if (model_dir / "config.json").is_file() else None)
    if model is None or is_s3(model):
        return None
    try:
        info = model_info(props, model, env, typed=False)
    except UserError:
        return None  # the plan or vLLM reports an unreadable model; only the TP choice needs it here
    if info.kv.num_attention_heads is None:
        return None
    return info.kv.num_attention_heads, max(1, info.kv.layout.num_kv_heads)
