"""Bodies of ``lmi-cache plan`` and ``lmi-cache validate`` (the CLI process; ``autoconfig.cli`` holds the flags).

``plan`` resolves its inputs exactly as ``serve --dry-run`` does: it prepares
serve's launch (nothing written, nothing started) and prints the tier plan with
the vLLM arguments serve would run, so the two commands cannot disagree.
``validate`` checks an LMCache YAML with the same settings resolution, host
sources and ``LMCACHE_*`` variables the server will read.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import click

from autoconfig.cli_inputs import HostSource, cli_settings, model_weights
from autoconfig.model.mistral import has_model_config

if TYPE_CHECKING:
    from autoconfig.serve.launch import ServeLaunch
    from autoconfig.validate import Finding

# How plan says what serve does with the cache, per mode (every mode the settings resolution gives).
_MODE_TEXT = {
    "auto": "auto-configured as planned above",
    "file": "from {file}, with the tiers above (checked against the host)",
    "env": "from LMCACHE_* variables, with the tiers above (checked against the host)",
    "off": "off (the plan above shows what option.lmcache_auto_config=true would size)",
}


def run_plan(model_dir: str | None, flags: Mapping[str, Any], source: HostSource, as_json: bool,
             echo: Callable[..., None] = click.echo) -> None:
    """Plan the tiers for the model and settings serve would run with; PlanError (exit 2) when it cannot start."""
    from autoconfig.serve.configure import NO_MODEL_DIR, plan_for
    from autoconfig.serve.launch import prepare_launch

    if flags.get("enable_blending") and flags.get("engine") == "lmcache":
        raise click.UsageError("--enable-blending plans lmi-cache's own blender; drop --engine lmcache")
    cli = cli_settings(flags)
    env = dict(os.environ)
    if model_dir is None:
        if "--model" not in cli:
            raise click.UsageError("give --model-dir DIR (serving.properties and/or the model) or --model MODEL")
        if not env.get("OPTION_LMCACHE_CONFIG_FILE") and not env.get("LMCACHE_CONFIG_FILE"):
            # plan --model alone answers "what would auto-configuration size": it asks for it.
            cli = {"plan": ("lmcache_auto_config", "true"), **cli}
    mdir = Path(model_dir) if model_dir is not None else NO_MODEL_DIR
    host = source.load(model_weights(mdir, env, cli))
    launch = prepare_launch(mdir, env, host=host, dry_run=True, cli=cli, check_output=False)
    assert launch.props is not None
    # The tiers serve will run, whichever way in sets them; with the cache off, what auto-config would size.
    plan = launch.tiers or launch.plan or plan_for(launch.props, mdir, host, env)
    plan = replace(plan, vllm_args=launch.engine_args)  # configure's vllm_args.json: what serve passes to vLLM
    if source.live and plan.disk.enabled and plan.disk.path:
        _refuse_unsafe_dir(plan.disk.path)
    cache = _MODE_TEXT[launch.mode].format(file=launch.props.config_file)
    if launch.mode in ("file", "env") and launch.tiers is None:
        cache += "; sizes not checked: the model's config.json cannot be read now"
    notes = launch.props.notes
    compare = launch.auto_plan if launch.mode in ("file", "env") else None
    if as_json:
        serve: dict[str, Any] = {"cache_mode": launch.mode, "cache": cache, "notes": notes, "vllm_args": launch.vllm_args()}
        if compare is not None:
            serve["auto_config_would_size"] = {"tiers": compare.to_dict()["tiers"], "chunk_size": compare.chunk_size}
        echo(json.dumps({**plan.to_dict(), "serve": serve}, indent=2))
        return
    from autoconfig.render.plan_text import format_plan

    echo(format_plan(plan, source.label), nl=False)
    echo("\nServe with these settings ('lmi-cache serve --dry-run' resolves them the same way):")
    echo(f"  cache: {cache}")
    if compare is not None:
        from autoconfig.serve.summary import planned_parts

        echo(f"  auto-configuration would size instead: {'; '.join(planned_parts(compare))}")
    for note in notes:
        echo(f"  note: {note}")
    echo(f"  vLLM arguments: {_shell(launch)}")


def _shell(launch: "ServeLaunch") -> str:
    import shlex

    return shlex.join(launch.vllm_args())


def run_validate(config: str | None, model_dir: str | None, flags: Mapping[str, Any], source: HostSource,
                 echo: Callable[[str], None] = click.echo) -> int:
    """Findings for the YAML (CONFIG, or the one the settings name); 1 when any is an error."""
    from autoconfig.serve.configure import DEFAULT_MODEL_DIR, NO_MODEL_DIR, resolve_fitted
    from autoconfig.serve.model_access import model_info
    from autoconfig.validate import blend_findings, validate_config

    cli = cli_settings(flags)
    env = dict(os.environ)
    mdir = Path(model_dir) if model_dir is not None else NO_MODEL_DIR
    host = source.load(model_weights(mdir, env, cli))
    props = resolve_fitted(mdir, env, len(host.gpus), cli)
    path = config or (str(props.config_file) if props.config_file is not None else env.get("LMCACHE_CONFIG_FILE"))
    if not path and not props.env_only:
        raise click.UsageError("give the LMCache YAML to check (CONFIG), or a --model-dir whose settings name "
                               "one (option.lmcache_config_file or LMCACHE_CONFIG_FILE), or set LMCACHE_* variables")
    model = props.model_id or (str(mdir) if has_model_config(mdir) else None)
    if model is None:
        where = model_dir or DEFAULT_MODEL_DIR
        raise click.UsageError(f"no model: give --model, or a --model-dir with config.json ({where} has none)")
    info = model_info(props, model, env)
    findings = (blend_findings(path, info) if path else []) + start_findings(info, props, env)
    findings += validate_config(path or None, info, props.settings, host, check_local_paths=source.live, env=env)
    findings += env_findings(env, over_file=bool(path))
    findings.sort(key=lambda f: f.level != "error")
    for finding in findings:
        echo(str(finding))
    errors = sum(f.level == "error" for f in findings)
    echo(f"{path or 'LMCACHE_* variables'}: {errors} error(s), {len(findings) - errors} warning(s) "
         f"(host from {source.label})")
    return 1 if errors else 0


def start_findings(info: Any, props: Any, env: Mapping[str, str]) -> list["Finding"]:
    """A max_model_len vLLM would refuse for this model (the size checks follow in validate_config)."""
    from autoconfig.plan.types import PlanError
    from autoconfig.plan.start_checks import check_max_model_len
    from autoconfig.validate import Finding

    opt = props.options.get("max_model_len")
    try:
        check_max_model_len(info.config, props.settings, env, opt.where if opt is not None else "max_model_len")
    except PlanError as err:
        return [Finding("error", "settings", str(err))]
    return []


def env_findings(env: Mapping[str, str], over_file: bool = True) -> list["Finding"]:
    """The LMCACHE_* variables the server reads on top of the file: a bad value is an error, overrides a warning.

    ``over_file``: a YAML is checked (without one, the variables override nothing).
    """
    from autoconfig.validate import Finding
    from lmi_cache.config.cache_config import CONFIG_FILE_ENV, env_override_names, load_config
    from lmi_cache.errors import ConfigError

    lmcache_env = {k: v for k, v in env.items() if k.startswith("LMCACHE_") and k != CONFIG_FILE_ENV}
    if not lmcache_env:
        return []
    try:
        _, warnings = load_config(None, lmcache_env)
    except ConfigError as err:
        return [Finding("error", "environment", str(err))]
    found = [Finding("warning", "environment", w) for w in warnings]
    overrides = env_override_names(lmcache_env) if over_file else []
    if overrides:
        found.append(Finding("warning", "environment", f"{', '.join(overrides)} override the file (the environment "
                             "wins over the YAML, as in LMCache)"))
    return found


def _refuse_unsafe_dir(path: str) -> None:
    """The planned disk-tier directory must be one only the serving user controls (or creatable as one)."""
    from autoconfig.plan.types import PlanError
    from lmi_cache.private_dir import private_dir_problem

    problem = private_dir_problem(path)
    if problem:
        raise PlanError(f"disk tier directory {path}: {problem} (set --disk-path, or --disk-size-gib 0 for no disk tier)")

