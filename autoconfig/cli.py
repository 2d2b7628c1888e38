"""The ``lmi-cache`` command line: a thin click shell over the pure core.

Runs in the user's shell or as the container entrypoint. Commands here:
``probe``, ``plan``, ``configure``, ``validate``. Other commands live in the
modules listed in ``COMMAND_MODULES``: each exposes ``register(group)`` that
calls ``group.add_command(...)``; append yours to the tuple. Imports of heavy
or optional modules stay inside the commands so ``lmi-cache plan`` starts fast.

Every ``UserError`` becomes one line on stderr, ``lmi-cache: error: <msg>``,
and exit status 2, never a traceback.
"""
from __future__ import annotations

import importlib
import json
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from autoconfig.cli_types import CHUNK_TOKENS, FRACTION, MODEL_LEN, PARALLEL_DEGREE, SIZE_GIB
from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from autoconfig.host import HostSnapshot

# Modules that add commands to ``main``, e.g. "autoconfig.cli_commands.serve"; each has
# ``register(group: click.Group) -> None`` (see autoconfig/cli_commands/__init__.py). Append yours.
COMMAND_MODULES: tuple[str, ...] = ("autoconfig.cli_serve", "lmi_cache.bench.cli")


class LmiCacheGroup(click.Group):
    """A click group whose ``main()`` turns user errors into one line and exit 2."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> NoReturn:  # type: ignore[override]
        try:
            result = super().main(args, prog_name or "lmi-cache", complete_var, standalone_mode=False, **extra)
        except UserError as err:
            click.echo(f"lmi-cache: error: {_one_line(str(err))}", err=True)
            sys.exit(err.exit_code)
        except click.ClickException as err:
            err.show()
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


def _with_blending(settings: Any, enabled: bool, ratios: str | None) -> Any:
    """``plan --enable-blending [--blend-recompute-ratios R]``: the LMI options' blending, for what-if plans."""
    if not enabled and ratios is None:
        return settings
    from dataclasses import replace

    from lmi_cache.blend.settings import BlendSettings

    if not enabled:
        raise click.UsageError("--blend-recompute-ratios needs --enable-blending")
    if settings.engine == "lmcache":
        raise click.UsageError("--enable-blending plans lmi-cache's own blender; drop --engine lmcache")
    values: dict[str, Any] = {"enable_blending": True}
    if ratios is not None:
        values["blend_recompute_ratios"] = ratios
    blend = BlendSettings.from_mapping(values, "--blend-recompute-ratios")  # a bad value: one line, exit 2
    return replace(settings, blend=blend, blend_where="--enable-blending")


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from autoconfig.lmi_to_vllm import vllm_table_version

    try:
        ours = version("lmi-cache")
    except PackageNotFoundError:
        ours = "unknown (not installed)"
    return f"{ours} (vLLM arguments of vLLM {vllm_table_version()})"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    # Computed only when asked: every other command keeps its start-up time.
    if value and not ctx.resilient_parsing:
        click.echo(f"lmi-cache {_version()}")
        ctx.exit()


@click.group(cls=LmiCacheGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the lmi-cache version (and the vLLM version its option table follows) and exit.")
def main() -> None:
    """KV-cache offloading for vLLM, configured from the host and the model."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the host snapshot JSON (the --host format).")
def probe(as_json: bool) -> None:
    """Probe GPUs, memory (cgroup, memlock, /dev/shm) and local disks."""
    from autoconfig.probe import probe_host

    snapshot = probe_host()
    if as_json:
        click.echo(json.dumps(snapshot.to_dict(), indent=2))
        return
    click.echo(_format_snapshot(snapshot))


def _host_options(func: Any) -> Any:
    func = click.option("--instance-type", help="Plan for a SageMaker instance type (what-if).")(func)
    func = click.option("--host", "host_file", type=click.Path(dir_okay=False),
                        help="Host snapshot JSON (from 'lmi-cache probe --json') instead of probing.")(func)
    return func


def _parallel_options(func: Any) -> Any:
    for name, text in (("--dp", "Data-parallel degree."), ("--pp", "Pipeline-parallel degree."),
                       ("--tp", "Tensor-parallel degree.")):
        func = click.option(name, type=PARALLEL_DEGREE, default=1, show_default=True, help=text)(func)
    return func


@main.command()
@click.option("--model", required=True, help="Model directory, config.json, or a locally cached HF id.")
@_parallel_options
@click.option("--kv-cache-dtype", default="auto", show_default=True, help="vLLM --kv-cache-dtype.")
@click.option("--dtype", default="auto", show_default=True, help="vLLM --dtype.")
@click.option("--gpu-memory-utilization", type=FRACTION, default=0.9,
              show_default=True, help="vLLM --gpu-memory-utilization.")
@click.option("--max-model-len", type=MODEL_LEN, help="vLLM --max-model-len (default: the model's).")
@click.option("--chunk-size", type=CHUNK_TOKENS, help="Tokens per chunk (default: chosen by the planner).")
@click.option("--cpu-size-gib", type=SIZE_GIB, help="Override: CPU tier GiB per rank (0: off); "
              "checked against the host (option.lmcache_max_local_cpu_size).")
@click.option("--disk-size-gib", type=SIZE_GIB, help="Override: disk tier GiB per rank (0: off); "
              "checked against free space (option.lmcache_max_local_disk_size).")
@click.option("--disk-path", help="Override: disk tier directory (option.lmcache_local_disk).")
@click.option("--engine", type=click.Choice(["lmi_cache", "lmcache"]), default="lmi_cache", show_default=True,
              help="lmcache: upstream LMCache's LMCacheConnectorV1.")
@click.option("--enable-blending", is_flag=True,
              help="Blend cached documents anywhere in the prompt (option.lmcache_enable_blending).")
@click.option("--blend-recompute-ratios", metavar="R[,R...]",
              help="Share of blended tokens recomputed per check layer (option.lmcache_blend_recompute_ratios).")
@_host_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan JSON contract.")
def plan(model: str, tp: int, pp: int, dp: int, kv_cache_dtype: str, dtype: str, gpu_memory_utilization: float,
         max_model_len: int | None, chunk_size: int | None, cpu_size_gib: float | None,
         disk_size_gib: float | None, disk_path: str | None, engine: str, enable_blending: bool,
         blend_recompute_ratios: str | None, host_file: str | None, instance_type: str | None,
         as_json: bool) -> None:
    """Size the KV tiers for MODEL on this host (or a snapshot / instance type)."""
    from autoconfig.model_source import load_model_info
    from autoconfig.planner import plan_tiers
    from autoconfig.settings import ServingSettings, TierOverrides

    settings = ServingSettings(tp=tp, pp=pp, dp=dp, gpu_memory_utilization=gpu_memory_utilization,
                               max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                               engine=engine, overrides=TierOverrides(chunk_size=chunk_size, cpu_size_gib=cpu_size_gib,
                                                              disk_size_gib=disk_size_gib, disk_path=disk_path))
    settings = _with_blending(settings, enable_blending, blend_recompute_ratios)
    info = load_model_info(model, kv_cache_dtype=kv_cache_dtype, dtype=dtype, allow_network=False)
    host, label, live = _load_host(host_file, instance_type, info.weights_bytes)
    space = _env_cpu_space() if live else None
    result = plan_tiers(host, info, settings, cpu_kvcache_space_gib=space)
    if live and result.disk.enabled and result.disk.path:
        _refuse_unsafe_dir(result.disk.path)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    from autoconfig.render.plan_text import format_plan

    click.echo(format_plan(result, label), nl=False)


@main.command()
@click.option("--model-dir", type=click.Path(file_okay=False), help="Model directory with serving.properties "
              "(default /opt/ml/model).")
@click.option("--output-dir", type=click.Path(file_okay=False), help="Where to write the files "
              "(default $LMI_CACHE_RUNTIME_DIR or /tmp/lmi-cache).")
def configure(model_dir: str | None, output_dir: str | None) -> None:
    """Container-start step: properties + env -> probe -> plan -> lmcache.yaml and vLLM args."""
    from autoconfig.configure import configure as run_configure

    result = run_configure(model_dir, output_dir)
    for line in result.messages:
        click.echo(line)
    click.echo(f"mode: {result.mode}")
    for name, path in result.written.items():
        click.echo(f"wrote {path}")
    if result.plan is not None:
        cfg = result.plan.lmcache_config
        click.echo(f"cpu tier {cfg['max_local_cpu_size']} GiB/rank, disk tier {cfg['max_local_disk_size']} "
                   f"GiB/rank, chunk {cfg['chunk_size']} tokens")


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--model", required=True, help="Model directory, config.json, or a locally cached HF id.")
@_parallel_options
@click.option("--kv-cache-dtype", default="auto", show_default=True, help="vLLM --kv-cache-dtype.")
@click.option("--gpu-memory-utilization", type=FRACTION, default=0.9,
              show_default=True, help="vLLM --gpu-memory-utilization.")
@click.option("--max-model-len", type=MODEL_LEN, help="vLLM --max-model-len (default: the model's).")
@_host_options
@click.pass_context
def validate(ctx: click.Context, config: str, model: str, tp: int, pp: int, dp: int, kv_cache_dtype: str,
             gpu_memory_utilization: float, max_model_len: int | None, host_file: str | None,
             instance_type: str | None) -> None:
    """Check a hand-written LMCache YAML against this host and MODEL (exit 1 on errors)."""
    from autoconfig.model_source import load_model_info
    from autoconfig.settings import ServingSettings
    from autoconfig.validate import blend_findings, validate_config

    settings = ServingSettings(tp=tp, pp=pp, dp=dp, kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                               gpu_memory_utilization=gpu_memory_utilization)
    info = load_model_info(model, kv_cache_dtype=kv_cache_dtype, allow_network=False)
    host, label, live = _load_host(host_file, instance_type, info.weights_bytes)
    findings = validate_config(config, info, settings, host, check_local_paths=live)
    findings = blend_findings(config, info) + findings  # errors, listed first as validate_config lists its own
    for finding in findings:
        click.echo(str(finding))
    errors = sum(f.level == "error" for f in findings)
    click.echo(f"{config}: {errors} error(s), {len(findings) - errors} warning(s) (host from {label})")
    if errors:
        ctx.exit(1)


def _load_host(host_file: str | None, instance_type: str | None,
               weights_bytes: int) -> tuple["HostSnapshot", str, bool]:
    """(snapshot, where it came from, whether it is this machine)."""
    from autoconfig.host import load_snapshot_file

    if host_file and instance_type:
        raise click.UsageError("use --host or --instance-type, not both")
    if host_file:
        return load_snapshot_file(host_file), host_file, False
    if instance_type:
        from autoconfig.catalog import host_snapshot_for

        return host_snapshot_for(instance_type, model_bytes_on_disk=weights_bytes), instance_type, False
    from autoconfig.probe import probe_host

    return probe_host(), "this machine", True


def _refuse_unsafe_dir(path: str) -> None:
    """The planned disk-tier directory must be one only the serving user controls (or creatable as one)."""
    from autoconfig.plan_types import PlanError
    from lmi_cache.private_dir import private_dir_problem

    problem = private_dir_problem(path)
    if problem:
        raise PlanError(f"disk tier directory {path}: {problem} (set --disk-path, or --disk-size-gib 0 for no disk tier)")


def _env_cpu_space() -> int | None:
    import os

    from autoconfig.configure import cpu_kvcache_space_from_env

    return cpu_kvcache_space_from_env(os.environ)


def _format_snapshot(snap: "HostSnapshot") -> str:
    gib = 1 << 30
    mem = snap.memory

    def size(value: int | None, none: str) -> str:
        return none if value is None else f"{value / gib:,.2f} GiB"

    lines = [f"GPUs: {len(snap.gpus) or 'none'}"]
    lines += [f"  [{g.index}] {g.name}: {size(g.memory_free_bytes, '?')} free of {size(g.memory_total_bytes, '?')}"
              for g in snap.gpus]
    lines += [f"Memory: {size(mem.available_bytes, '?')} available of {size(mem.total_bytes, '?')}; cgroup limit "
              f"{size(mem.cgroup_limit_bytes, 'none')}; memlock {size(mem.memlock_limit_bytes, 'unlimited')}; "
              f"/dev/shm {size(mem.shm_bytes, '?')}; usable {size(mem.usable_bytes, '?')}",
              f"CPUs: {snap.cpu_count if snap.cpu_count is not None else 'unknown'}", "Disks:"]
    for d in snap.disks:
        kind = "NVMe" if d.nvme else {True: "rotational", False: "SSD", None: "unknown"}[d.rotational]
        flags = [f for f, on in (("tmpfs", d.is_tmpfs), ("overlay", d.is_overlay), ("network", d.is_network),
                                 ("read-only", not d.writable)) if on]
        lines.append(f"  {d.mount} ({d.fs_type} on {d.device}, {kind}{', ' + ', '.join(flags) if flags else ''}): "
                     f"{size(d.free_bytes, '?')} free of {size(d.total_bytes, '?')}, O_DIRECT {d.odirect}")
    return "\n".join(lines)


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(main)


if __name__ == "__main__":
    main()
