"""The container-start step: properties + env -> probe -> plan -> files for the server.

Run once by ``lmi-cache configure`` (and by ``lmi-cache serve`` before it
starts vLLM). Everything is computed first and written last, each file through
a temporary file and a rename, so an error leaves nothing half-written.

Files written under the output directory:
  lmcache.yaml      LMCache-format config (auto mode)
  plan.json         the ``plan --json`` document (auto mode)
  vllm_args.json    JSON list of extra vLLM arguments
  env.json          environment the server must run with (LMCACHE_CONFIG_FILE, ...)
  env.sh            the same as ``export`` lines, for shell entrypoints
  vllm_secrets.yaml several API keys, as a vLLM ``--config`` file (mode 0600; serve only)

The output directory (``$LMI_CACHE_RUNTIME_DIR``, default /tmp/lmi-cache) is
used only when it is private to the serving user: created 0700, or adopted
when we own it (see ``lmi_cache.private_dir``). One owned by another user is
refused: they could swap the YAML before vLLM reads it. ``write=False``
(``serve --dry-run``) computes and checks everything and writes nothing.
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from autoconfig.lmi.properties import ResolvedProperties, resolve_properties
from autoconfig.serve.engine_args import engine_args, mapped_options
from autoconfig.serve.model_access import model_here, model_info
from autoconfig.model.mistral import has_model_config, mistral_format_args
from lmi_cache.config.env import env_override_line, env_override_names
from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from autoconfig.lmi.to_vllm import MappedArgs
    from autoconfig.probe.snapshot import HostSnapshot
    from autoconfig.plan.types import TierPlan

DEFAULT_MODEL_DIR = "/opt/ml/model"  # SageMaker / LMI convention
# "No model directory" (``plan --model X`` alone): not a directory, so no serving.properties is read.
NO_MODEL_DIR = Path(os.devnull)
DEFAULT_OUTPUT_DIR = "/tmp/lmi-cache"
RUNTIME_DIR_ENV = "LMI_CACHE_RUNTIME_DIR"
OUTPUT_FILES = ("lmcache.yaml", "plan.json", "vllm_args.json", "env.json", "env.sh", "vllm_secrets.yaml")
PRIVATE_FILES = frozenset({"vllm_secrets.yaml"})  # written 0600: they hold secrets


class ConfigureError(UserError):
    """The configure step cannot produce a usable configuration (names what to fix)."""


@dataclass(frozen=True)
class ConfigureResult:
    mode: str  # "auto" (planned), "file" (the user's YAML), "env" (LMCACHE_* variables alone) or "off"
    output_dir: Path
    written: dict[str, Path]
    properties: ResolvedProperties
    plan: "TierPlan | None" = None
    env: dict[str, str] = field(default_factory=dict)
    vllm_args: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    arg_notes: list[str] = field(default_factory=list)  # why configure added vLLM arguments no option named


def default_output_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get(RUNTIME_DIR_ENV) or DEFAULT_OUTPUT_DIR)


def configure(
    model_dir: str | Path | None = None,
    output_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    *,
    host: "HostSnapshot | None" = None,
    probe: "Callable[[], HostSnapshot] | None" = None,
    write: bool = True,
    extra_files: "Mapping[str, str] | None" = None,
    model: str | None = None,
    resolved: ResolvedProperties | None = None,
    check_output: bool = True,
    mapped: "MappedArgs | None" = None,
) -> ConfigureResult:
    """Resolve properties, probe (unless ``host`` is given), plan and write the files.

    ``extra_files`` (name -> text, names from OUTPUT_FILES) are written with the
    others; ``write=False`` checks the directory and writes nothing; ``model``
    replaces option.model_id where config.json is read (an S3 model's local copy);
    ``resolved`` is serve's own resolution of the same properties (with its TP fit);
    ``check_output=False`` (``plan``, with ``write=False``) skips the runtime directory check;
    ``mapped``: serve's mapping of the other LMI options (computed here when not given).
    vllm_args.json holds every vLLM argument serve passes after ``--model`` except the front door's.
    """
    from autoconfig.render.vllm_args import vllm_args as render_args

    env = dict(os.environ if env is None else env)
    mdir = Path(model_dir) if model_dir is not None else Path(DEFAULT_MODEL_DIR)
    out = Path(output_dir) if output_dir is not None else default_output_dir(env)
    if host is None:
        if probe is None:
            from autoconfig.probe import probe_host

            probe = probe_host
        host = probe()
    props = resolved or resolve_fitted(mdir, env, len(host.gpus))
    messages = [f"option {line}" for line in props.summary_lines()] + [f"note: {n}" for n in props.notes]
    plan = None
    run_env: dict[str, str] = {}
    files: dict[str, str] = {}
    if props.auto_config:
        plan = plan_for(props, mdir, host, env, model)
        yaml_path = out / "lmcache.yaml"
        files["lmcache.yaml"] = _yaml_text(plan)
        run_env = {"LMCACHE_CONFIG_FILE": str(yaml_path), **plan.env}
        args = list(plan.vllm_args)
        messages += [f"warning: {w}" for w in plan.warnings]
        mode = "auto"
    elif props.cache_on:  # the user's YAML, or LMCACHE_* variables alone
        if props.config_file is not None:
            _check_user_config(props.config_file, props.config_where)
        if props.settings.blend_connector:
            _check_blend_model(props, mdir, env, model)
            messages.append(f"note: blending on ({props.settings.blend_where}): LmiCacheConnector blends")
        run_env = {"LMCACHE_CONFIG_FILE": str(props.config_file)} if props.config_file is not None else {}
        args = render_args(None, props.settings)
        mode = "file" if props.config_file is not None else "env"
    else:
        from autoconfig.lmi.cache_ways import refuse_cache_options

        refuse_cache_options(props.options)
        # No cache requested: still hand vLLM the parallel flags, without a connector.
        args = render_args(None, props.settings)[2:]
        mode = "off"
        messages.append("LMCache off: set option.lmcache_auto_config=true or option.lmcache_config_file")
    mapped = mapped or mapped_options(props)
    args = engine_args(props, args, mapped)
    # A params.json-only directory: vLLM reads it the Mistral way only when told (config, tokenizer, weights).
    format_args, format_note = mistral_format_args(Path(model or props.model_id or mdir), mapped.values)
    args += format_args
    arg_notes = [format_note] if format_note else []
    messages += [f"note: {n}" for n in arg_notes]
    if plan is not None:
        plan = replace(plan, vllm_args=args)
        files["plan.json"] = json.dumps(plan.to_dict(), indent=2) + "\n"
    overrides = env_override_names(env) if mode in ("auto", "file") else []
    if overrides:  # LMCache's rule, which the engine follows: LMCACHE_<KEY> beats the YAML
        messages.append(f"warning: {env_override_line(overrides)}")
    if mode != "off":
        from autoconfig.probe.remote_store import remote_store_messages

        messages += remote_store_messages(plan.lmcache_config if plan is not None else None, props.config_file, env)
    files["vllm_args.json"] = json.dumps(args) + "\n"
    files["env.json"] = json.dumps(run_env, indent=2, sort_keys=True) + "\n"
    files["env.sh"] = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(run_env.items()))
    files.update(extra_files or {})
    if write:
        written = write_files_atomically(out, files)
    else:
        if check_output:
            check_runtime_dir(out)
        written = {}
    return ConfigureResult(mode, out, written, props, plan, run_env, args, messages, arg_notes)


def plan_for(props: ResolvedProperties, mdir: Path, host: "HostSnapshot", env: Mapping[str, str],
             model_override: str | None = None) -> "TierPlan":
    """The auto-configuration plan for these settings (configure's, and ``plan``'s what-if in other modes)."""
    from autoconfig.plan.planner import plan_tiers

    model = model_override or props.model_id or (str(mdir) if has_model_config(mdir) else None)
    if model is None:
        raise ConfigureError(f"no model: {mdir} has no config.json and option.model_id / HF_MODEL_ID is unset; "
                             "set one of them or pass --model-dir")
    info = model_info(props, model, env)
    if info.kv.state is not None and props.settings.engine != "lmi_cache":
        from autoconfig.model.ssm import refuse_state_caching

        refuse_state_caching(info.kv.state, model)
    from autoconfig.plan.tier_labels import option_labels, relabel, relabel_plan
    from autoconfig.plan.types import PlanError

    labels = option_labels(props.options)  # messages name the option, variable or flag as the user gave it
    try:
        plan = plan_tiers(host, info, props.settings, cpu_kvcache_space_gib=cpu_kvcache_space_from_env(env))
    except PlanError as err:
        raise PlanError(relabel(str(err), labels)) from None
    return relabel_plan(plan, labels)


def _check_blend_model(props: ResolvedProperties, mdir: Path, env: Mapping[str, str],
                       model_override: str | None) -> None:
    """With the user's YAML blending: refuse a model the blender does not cover now, when config.json is at hand."""
    from autoconfig.plan.blend import check_blend_model
    from autoconfig.model.s3 import is_s3

    model = model_override or props.model_id or (str(mdir) if has_model_config(mdir) else None)
    if model is None or is_s3(model):
        return  # the blending connector checks the model when vLLM starts it
    info = model_info(props, model, env)
    check_blend_model(props.settings, info.config, info.name, info.kv.layout.num_layers)


def resolve_fitted(mdir: Path, env: Mapping[str, str], num_gpus: int,
                   cli: Mapping[str, tuple[str, str]] | None = None) -> ResolvedProperties:
    """The one resolution of settings every command uses (``cli``: the flags of plan / validate on top).

    LMI's tensor_parallel_degree "max" is fitted to the model's heads when they can be read.
    """
    from autoconfig.serve.checks import largest_fitting_tp, model_heads

    directory = mdir if mdir.is_dir() else None
    props = model_here(resolve_properties(directory, env, gpu_count=num_gpus, cli=cli), mdir)
    heads = model_heads(props, mdir, env) if props.tp_is_max and props.settings.tp > 1 else None
    if heads is None:
        return props
    return model_here(resolve_properties(directory, env, gpu_count=num_gpus,
                                          fit_max_tp=lambda n: largest_fitting_tp(n, heads), cli=cli), mdir)


def cpu_kvcache_space_from_env(env: Mapping[str, str]) -> int | None:
    """VLLM_CPU_KVCACHE_SPACE as vLLM reads it (whole GiB), or None when unset/empty."""
    raw = env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ConfigureError(f"environment variable VLLM_CPU_KVCACHE_SPACE={raw!r}: must be a whole number of GiB >= 1")
    return value


def _yaml_text(plan: "TierPlan") -> str:
    from autoconfig.render.lmcache_yaml import render_yaml

    header = (f"Written by lmi-cache configure for {plan.model_name or 'the model'}: sizes are GiB per rank.\n"
              "See plan.json beside this file for how each number was computed.")
    return render_yaml(plan.lmcache_config, header=header)


def _check_user_config(path: Path, where: str) -> None:
    from lmi_cache.config.cache_config import load_config

    check_yaml_path(path, where)
    load_config(str(path), env={})  # raises ConfigError naming the file and key


def check_yaml_path(path: Path, where: str) -> None:
    """The user's YAML must be a file: a directory or a missing path says which."""
    if path.is_dir():
        raise ConfigureError(f"{where}: {path} is a directory, not an LMCache YAML file; name the file")
    if not path.is_file():
        raise ConfigureError(f"{where}: {path} does not exist; fix the path "
                             "(relative paths are resolved against the model directory)")


def check_runtime_dir(out: Path) -> None:
    """The same check ``write_files_atomically`` makes, without creating or changing anything."""
    from lmi_cache.private_dir import private_dir_problem

    problem = private_dir_problem(out)
    if problem:
        raise ConfigureError(f"runtime directory ({RUNTIME_DIR_ENV} or --output-dir): {problem}")


def write_files_atomically(out: Path, files: Mapping[str, str]) -> dict[str, Path]:
    """Write every file to a temp name, then rename them all; on any error remove the temps.

    Files of ours from an earlier run that this run does not write are removed,
    so a stale lmcache.yaml never outlives a switch to another mode.
    """
    from lmi_cache.private_dir import UnsafeDirectoryError, ensure_private_dir

    try:
        out = ensure_private_dir(out)
    except UnsafeDirectoryError as err:
        raise ConfigureError(f"runtime directory ({RUNTIME_DIR_ENV} or --output-dir): {err}") from None
    temps: dict[str, Path] = {}
    try:
        for name, text in files.items():
            tmp = out / f".{name}.tmp-{os.getpid()}"
            temps[name] = tmp
            mode = 0o600 if name in PRIVATE_FILES else 0o644
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
            with open(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
    except OSError as err:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise ConfigureError(f"--output-dir {out}: cannot write ({err.strerror}); choose a writable directory")
    written = {}
    for name, tmp in temps.items():
        os.replace(tmp, out / name)
        written[name] = out / name
    for stale in set(OUTPUT_FILES) - set(files):
        (out / stale).unlink(missing_ok=True)
    return written
