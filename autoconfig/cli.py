"""The ``lmi-cache`` command line: a thin click shell over the pure core.

Runs in the user's shell or as the container entrypoint. Commands here:
``probe``, ``plan``, ``configure``, ``validate``; ``serve`` and ``sagemaker``
come from ``autoconfig.cli_serve`` and ``bench`` from ``lmi_cache.bench.cli``,
each through its ``register(group)``. Imports of heavy or optional modules
stay inside the commands so ``lmi-cache plan`` starts fast.

Every ``UserError`` becomes one line on stderr, ``lmi-cache: error: <msg>``,
and exit status 2, never a traceback.
"""
from __future__ import annotations

import errno
import json
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from autoconfig import cli_serve
from autoconfig.cli_inputs import HostSource, host_options, model_weights, setting_options
from lmi_cache.bench import cli as bench_cli
from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from autoconfig.probe.snapshot import HostSnapshot

class LmiCacheGroup(click.Group):
    """A click group whose ``main()`` turns user errors into one line and exit 2."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> NoReturn:  # type: ignore[override]
        try:
            result = super().main(args, prog_name or "lmi-cache", complete_var, standalone_mode=False, **extra)
        except UserError as err:
            click.echo(f"lmi-cache: error: {_one_line(str(err))}", err=True)
            sys.exit(err.exit_code)
        except click.UsageError as err:  # a mistyped flag or value: one line, with click's did-you-mean
            where = f" (see '{err.ctx.command_path} --help')" if err.ctx is not None else ""
            click.echo(f"lmi-cache: error: {_one_line(err.format_message())}{where}", err=True)
            sys.exit(err.exit_code)
        except OSError as err:
            if err.errno != errno.ENAMETOOLONG:
                raise
            name = str(err.filename or "")
            click.echo(f"lmi-cache: error: path {name[:60]!r}... is longer than the system allows; shorten it",
                       err=True)
            sys.exit(2)
        except click.ClickException as err:
            err.show()
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        """click's, with a did-you-mean for a mistyped command name."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            import difflib

            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            ctx.fail(f"No such command {name[:60]!r}.{hint}")
        return super().resolve_command(ctx, args)


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from autoconfig.lmi.to_vllm import vllm_table_version

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
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the host snapshot JSON (the --host-snapshot format).")
def probe(host_file: str | None, instance_type: str | None, as_json: bool) -> None:
    """Probe GPUs, memory (cgroup, memlock, /dev/shm) and local disks (or show an instance type's)."""
    snapshot = HostSource(host_file, instance_type).load()
    if as_json:
        click.echo(json.dumps(snapshot.to_dict(), indent=2))
        return
    click.echo(_format_snapshot(snapshot))


@main.command()
@setting_options
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan JSON contract (with serve's vLLM arguments).")
def plan(model_dir: str | None, host_file: str | None, instance_type: str | None, as_json: bool,
         **flags: Any) -> None:
    """Size the KV tiers as serve would for --model-dir (or --model) on this host, a snapshot or an instance type."""
    from autoconfig.cli_plan import run_plan

    run_plan(model_dir, flags, HostSource(host_file, instance_type), as_json)


@main.command()
@click.option("--model-dir", type=click.Path(file_okay=False), help="Model directory with serving.properties "
              "(default /opt/ml/model).")
@click.option("--output-dir", type=click.Path(file_okay=False), help="Where to write the files "
              "(default $LMI_CACHE_RUNTIME_DIR or /tmp/lmi-cache).")
@host_options
def configure(model_dir: str | None, output_dir: str | None, host_file: str | None,
              instance_type: str | None) -> None:
    """Container-start step: properties + env -> probe -> plan -> lmcache.yaml and vLLM args."""
    import os
    from pathlib import Path

    from autoconfig.serve.configure import DEFAULT_MODEL_DIR, configure as run_configure

    source = HostSource(host_file, instance_type)
    host = None if source.live else source.load(model_weights(Path(model_dir or DEFAULT_MODEL_DIR), os.environ, {}))
    result = run_configure(model_dir, output_dir, host=host)
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
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@setting_options
@host_options
@click.pass_context
def validate(ctx: click.Context, config: str | None, model_dir: str | None, host_file: str | None,
             instance_type: str | None, **flags: Any) -> None:
    """Check an LMCache YAML (CONFIG, or the one --model-dir's settings name) with LMCACHE_* against a host."""
    from autoconfig.cli_plan import run_validate

    if run_validate(config, model_dir, flags, HostSource(host_file, instance_type)):
        ctx.exit(1)


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


cli_serve.register(main)
bench_cli.register(main)


if __name__ == "__main__":
    main()
