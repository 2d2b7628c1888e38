"""The inputs every ``lmi-cache`` command shares: the model directory, settings flags and the host source.

Runs in the CLI process (the user's shell or the container's entrypoint), before
any planning. ``plan``, ``serve`` (and ``--dry-run``), ``validate``, ``configure``
and ``probe`` take the same host sources (``--host FILE``, ``--instance-type NAME``
or a live probe) and resolve settings through one function,
``autoconfig.serve.configure.resolve_fitted``: serving.properties + ``OPTION_*`` +
LMI's simplified variables, with the flags of ``plan`` / ``validate`` on top
(``SETTING_FLAGS``). Keep module-level imports light: ``plan`` must start fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import click

from autoconfig.cli_types import CHUNK_TOKENS, FRACTION, MODEL_LEN, PARALLEL_DEGREE, SIZE_GIB, TP_DEGREE
from autoconfig.model.mistral import has_model_config

if TYPE_CHECKING:
    from autoconfig.probe.snapshot import HostSnapshot

# Flag -> the LMI option it sets (same parsing and checks as option.<name> in serving.properties).
SETTING_FLAGS: dict[str, str] = {
    "--model": "model_id", "--tp": "tensor_parallel_degree", "--pp": "pipeline_parallel_degree",
    "--dp": "data_parallel_degree", "--dtype": "dtype", "--kv-cache-dtype": "kv_cache_dtype",
    "--gpu-memory-utilization": "gpu_memory_utilization", "--max-model-len": "max_model_len",
    "--chunk-size": "lmcache_chunk_size", "--cpu-size-gib": "lmcache_max_local_cpu_size",
    "--disk-size-gib": "lmcache_max_local_disk_size", "--disk-path": "lmcache_local_disk",
    "--engine": "lmcache_engine", "--enable-blending": "lmcache_enable_blending",
    "--blend-recompute-ratios": "lmcache_blend_recompute_ratios",
}


@dataclass(frozen=True)
class HostSource:
    """Where a command's host comes from: a snapshot file, an instance type, or this machine."""

    host_file: str | None = None
    instance_type: str | None = None

    def __post_init__(self) -> None:
        if self.host_file and self.instance_type:
            raise click.UsageError("use --host-snapshot or --instance-type, not both")

    @property
    def live(self) -> bool:
        """Whether the host is this machine (paths and free space can be checked)."""
        return not self.host_file and not self.instance_type

    @property
    def label(self) -> str:
        return self.host_file or self.instance_type or "this machine"

    def gpu_count(self) -> int | None:
        """The GPUs, when known without a probe (the instance type's)."""
        if self.instance_type:
            from autoconfig.probe.catalog import get_instance

            return get_instance(self.instance_type).gpu_count
        return None

    def load(self, weights_bytes: Callable[[int], int] = lambda _gpus: 0) -> "HostSnapshot":
        """The snapshot; ``weights_bytes(gpus)`` is what an instance type's NVMe gives to the downloaded model."""
        if self.host_file:
            from autoconfig.probe.snapshot import load_snapshot_file

            return load_snapshot_file(self.host_file)
        if self.instance_type:
            from autoconfig.probe.catalog import host_snapshot_for

            gpus = self.gpu_count() or 0
            return host_snapshot_for(self.instance_type, model_bytes_on_disk=weights_bytes(gpus))
        from autoconfig.probe import probe_host

        return probe_host()


SNAPSHOT_FLAG = "--host-snapshot"


def _old_snapshot_flag(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """``--host FILE``: the snapshot, with one deprecation line (``--host-snapshot`` wins when both are given)."""
    if value is None or ctx.resilient_parsing:
        return
    click.echo(f"lmi-cache: warning: --host FILE is deprecated (serve passes --host to vLLM); use "
               f"{SNAPSHOT_FLAG} {value}", err=True)
    if ctx.params.get("host_file") is None:
        ctx.params["host_file"] = value


def host_options(func: Any, *, old_spelling: bool = True) -> Any:
    """``--host-snapshot FILE`` / ``--instance-type NAME``: the same on every command.

    ``old_spelling``: ``--host FILE`` still names a snapshot, with a deprecation line (not on
    ``serve``, where ``--host`` is vLLM's listen address).
    """
    func = click.option("--instance-type", help="Use a SageMaker instance type's host (what-if) instead of "
                        "probing this machine.")(func)
    if old_spelling:
        func = click.option("--host", "old_host_file", type=click.Path(dir_okay=False), hidden=True,
                            expose_value=False, callback=_old_snapshot_flag)(func)
    func = click.option(SNAPSHOT_FLAG, "host_file", type=click.Path(dir_okay=False),
                        help="Host snapshot JSON (from 'lmi-cache probe --json') instead of probing.")(func)
    return func


def setting_options(func: Any) -> Any:
    """The flags that stand for LMI options (unset: serving.properties / OPTION_* / LMI's default)."""
    specs: list[tuple[str, Any, str]] = [
        ("--blend-recompute-ratios", str, "Share of blended tokens recomputed per check layer "
         "(option.lmcache_blend_recompute_ratios)."),
        ("--engine", click.Choice(["lmi_cache", "lmcache"]), "lmcache: upstream LMCache's LMCacheConnectorV1 "
         "(option.lmcache_engine; default lmi_cache)."),
        ("--disk-path", str, "Disk tier directory (option.lmcache_local_disk)."),
        ("--disk-size-gib", SIZE_GIB, "Disk tier GiB per rank, 0: off (option.lmcache_max_local_disk_size)."),
        ("--cpu-size-gib", SIZE_GIB, "CPU tier GiB per rank, 0: off (option.lmcache_max_local_cpu_size)."),
        ("--chunk-size", CHUNK_TOKENS, "Tokens per chunk (option.lmcache_chunk_size; default: planned)."),
        ("--max-model-len", MODEL_LEN, "vLLM --max-model-len (option.max_model_len; default: the model's)."),
        ("--gpu-memory-utilization", FRACTION, "vLLM --gpu-memory-utilization (option.gpu_memory_utilization; "
         "default 0.9)."),
        ("--kv-cache-dtype", str, "vLLM --kv-cache-dtype (option.kv_cache_dtype; default auto)."),
        ("--dtype", str, "Model dtype: LMI's fp16/bf16/fp32 or vLLM's names (option.dtype; default auto)."),
        ("--dp", PARALLEL_DEGREE, "Data-parallel degree (option.data_parallel_degree)."),
        ("--pp", PARALLEL_DEGREE, "Pipeline-parallel degree (option.pipeline_parallel_degree; default 1)."),
        ("--tp", TP_DEGREE, "Tensor-parallel degree or 'max' (option.tensor_parallel_degree; default max, "
         "LMI's: every GPU, fitted to the model's heads)."),
    ]
    func = click.option("--enable-blending", is_flag=True, default=None,
                        help="Blend cached documents anywhere in the prompt (option.lmcache_enable_blending).")(func)
    for flag, kind, text in specs:
        func = click.option(flag, flag.lstrip("-").replace("-", "_"), type=kind, help=text)(func)
    func = click.option("--model-dir", type=click.Path(file_okay=False), help="Model directory with "
                        "serving.properties (read with OPTION_* and LMCACHE_* as serve reads them).")(func)
    func = click.option("--model", help="Model directory, config.json, or a Hugging Face id "
                        "(option.model_id).")(func)
    return func


def cli_settings(values: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The setting flags given on the command line: flag -> (option name, value as LMI writes it)."""
    if values.get("blend_recompute_ratios") is not None and not values.get("enable_blending"):
        raise click.UsageError("--blend-recompute-ratios needs --enable-blending")
    out: dict[str, tuple[str, str]] = {}
    for flag, name in SETTING_FLAGS.items():
        value = values.get(flag.lstrip("-").replace("-", "_"))
        if value is None or value is False:
            continue
        out[flag] = (name, "true" if value is True else str(value))
    return out


def model_weights(model_dir: Path, env: Mapping[str, str], cli: Mapping[str, tuple[str, str]]
                  ) -> Callable[[int], int]:
    """For an instance type: the model's weight bytes (0 when config.json cannot be read yet)."""

    def weights(gpus: int) -> int:
        from autoconfig.serve.configure import resolve_fitted
        from autoconfig.serve.model_access import model_info
        from autoconfig.model.s3 import is_s3
        from lmi_cache.errors import UserError

        try:
            props = resolve_fitted(model_dir, env, gpus, cli)
            model = props.model_id or (str(model_dir) if has_model_config(model_dir) else None)
            if model is None or is_s3(model):
                return 0
            return model_info(props, model, env).weights_bytes
        except UserError:
            return 0  # the command itself reports the bad setting, with its own message

    return weights
