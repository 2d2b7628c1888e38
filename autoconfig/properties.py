"""LMI ``serving.properties`` + ``OPTION_*`` environment -> typed serving settings.

Run at container start (``lmi-cache configure`` / ``serve``). Follows LMI's
rules: ``option.<name>`` in serving.properties and ``OPTION_<NAME>`` in the
environment are the same setting, and serving.properties wins. All raw options
are kept (``serve`` maps the rest to vLLM engine arguments), with where each
came from. Tier overrides the planner honours (per rank, LMCache semantics):

- ``option.lmcache_max_local_cpu_size``  CPU tier GiB per rank (0 disables it)
- ``option.lmcache_max_local_disk_size`` disk tier GiB per rank (0 disables it)
- ``option.lmcache_local_disk``          disk tier directory (path or file:// URL)
- ``option.lmcache_chunk_size``          tokens per chunk (multiple of vLLM's block size)
- ``option.lmcache_use_odirect``         true/false: O_DIRECT for the disk tier
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from autoconfig.java_properties import parse_properties
from autoconfig.settings import ServingSettings, TierOverrides
from lmi_cache.errors import UserError

PROPERTIES_FILE = "serving.properties"
ENV_SOURCE = "environment"
T = TypeVar("T")


class PropertiesError(UserError):
    """A bad value in serving.properties or an OPTION_* variable (names the file/variable and key)."""


@dataclass(frozen=True)
class RawOption:
    name: str  # canonical: lower case, dots -> underscores ("tensor_parallel_degree")
    value: str
    key: str  # as written: "option.tensor_parallel_degree" or "OPTION_TENSOR_PARALLEL_DEGREE"
    source: str  # the serving.properties path, or "environment"

    @property
    def where(self) -> str:
        """How an error message names this option."""
        if self.source == ENV_SOURCE:
            return f"environment variable {self.key}"
        return f"{self.source}: {self.key}"


@dataclass(frozen=True)
class ResolvedProperties:
    model_dir: Path | None
    properties_path: Path | None  # None when the model dir has no serving.properties
    model_id: str | None
    auto_config: bool
    config_file: Path | None  # option.lmcache_config_file, resolved against model_dir
    settings: ServingSettings
    options: dict[str, RawOption] = field(default_factory=dict)  # every option.* / OPTION_* seen
    other_properties: dict[str, str] = field(default_factory=dict)  # non-option keys (engine=...)

    def summary_lines(self) -> list[str]:
        """One line per option with its origin, for the configure log."""
        return [f"{o.name} = {o.value}  ({o.where})" for o in sorted(self.options.values(), key=lambda o: o.name)]


def canonical_name(name: str) -> str:
    return name.strip().lower().replace(".", "_").replace("-", "_")


def collect_options(file_props: Mapping[str, str], source: str, env: Mapping[str, str]) -> dict[str, RawOption]:
    """Merge ``option.*`` from the file and ``OPTION_*`` from env; the file wins (LMI's rule)."""
    merged: dict[str, RawOption] = {}
    for key, value in env.items():
        if key.startswith("OPTION_") and len(key) > len("OPTION_"):
            name = canonical_name(key[len("OPTION_"):])
            merged[name] = RawOption(name, value, key, ENV_SOURCE)
    for key, value in file_props.items():
        if key.startswith("option."):
            name = canonical_name(key[len("option."):])
            merged[name] = RawOption(name, value, key, source)
    return merged


def resolve_properties(
    model_dir: str | Path | None,
    env: Mapping[str, str] | None = None,
    *,
    gpu_count: int | None = None,
) -> ResolvedProperties:
    """Read ``<model_dir>/serving.properties`` (if any) and env; type and check every known option.

    ``gpu_count`` resolves ``tensor_parallel_degree=max`` (None: treated as 1 GPU).
    """
    env = dict(os.environ if env is None else env)
    mdir = Path(model_dir) if model_dir is not None else None
    path = mdir / PROPERTIES_FILE if mdir is not None and (mdir / PROPERTIES_FILE).is_file() else None
    file_props: dict[str, str] = {}
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise PropertiesError(f"{path}: cannot read ({err.__class__.__name__}: {err}); fix its permissions/encoding")
        file_props = parse_properties(text, str(path))
    options = collect_options(file_props, str(path), env)
    _apply_env_defaults(options, env)
    get = _Getter(options)

    tp = get.value("tensor_parallel_degree", lambda v: _parse_tp(v, gpu_count), 1)
    settings = ServingSettings(
        tp=tp,
        pp=get.value("pipeline_parallel_degree", _positive_int, 1),
        dp=get.value("data_parallel_degree", _positive_int, 1),
        gpu_memory_utilization=get.value("gpu_memory_utilization", _fraction, 0.9),
        max_model_len=get.value("max_model_len", _positive_int, None),
        kv_cache_dtype=get.value("kv_cache_dtype", _word, "auto"),
        dtype=get.value("dtype", _word, "auto"),
        overrides=TierOverrides(
            cpu_size_gib=get.value("lmcache_max_local_cpu_size", _gib, None),
            disk_size_gib=get.value("lmcache_max_local_disk_size", _gib, None),
            disk_path=get.value("lmcache_local_disk", _abs_path, None),
            chunk_size=get.value("lmcache_chunk_size", _positive_int, None),
            use_odirect=get.value("lmcache_use_odirect", parse_bool, None),
        ),
    )
    auto = get.value("lmcache_auto_config", parse_bool, False)
    config_file = get.value("lmcache_config_file", lambda v: _config_path(v, mdir), None)
    if auto and config_file is not None:
        raise PropertiesError(
            f"{options['lmcache_auto_config'].where}=true and {options['lmcache_config_file'].where} are both "
            "set: choose one (auto-configuration writes its own LMCache config)"
        )
    model_id = get.value("model_id", _nonempty, None)
    others = {k: v for k, v in file_props.items() if not k.startswith("option.")}
    return ResolvedProperties(mdir, path, model_id, auto, config_file, settings, options, others)


def _apply_env_defaults(options: dict[str, RawOption], env: Mapping[str, str]) -> None:
    """SageMaker's SM_NUM_GPUS / HF_MODEL_ID fill tensor_parallel_degree / model_id only when unset."""
    for var, name in (("SM_NUM_GPUS", "tensor_parallel_degree"), ("HF_MODEL_ID", "model_id")):
        if name not in options and env.get(var, "").strip():
            options[name] = RawOption(name, env[var], var, ENV_SOURCE)


class _Getter:
    def __init__(self, options: Mapping[str, RawOption]) -> None:
        self._options = options

    def value(self, name: str, convert: Callable[[str], T], default: T) -> T:
        opt = self._options.get(name)
        if opt is None:
            return default
        try:
            return convert(opt.value.strip())
        except ValueError as err:
            raise PropertiesError(f"{opt.where}={opt.value!r}: {err}") from None


def parse_bool(value: str) -> bool:
    """LMI booleans: true/false in any case; anything else is an error, not silently false."""
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    raise ValueError("must be true or false")


def _parse_tp(value: str, gpu_count: int | None) -> int:
    if value.lower() == "max":
        return max(1, gpu_count or 0)
    try:
        return _positive_int(value)
    except ValueError:
        raise ValueError("must be a positive integer or 'max' (all GPUs)") from None


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError("must be a positive integer") from None
    if number < 1:
        raise ValueError("must be a positive integer")
    return number


def _fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError("must be a number in (0, 1]") from None
    if not 0 < number <= 1:
        raise ValueError("must be a number in (0, 1]")
    return number


def _gib(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError("must be a size in GiB per rank (a number, 0 disables the tier)") from None
    if not number >= 0 or number == float("inf"):
        raise ValueError("must be a size in GiB per rank, 0 or more")
    return number


def _word(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise ValueError("must be one word, e.g. auto, bfloat16, fp8")
    return value


def _nonempty(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def _abs_path(value: str) -> str:
    path = value[len("file://"):] if value.startswith("file://") else value
    if not path.startswith("/"):
        raise ValueError("must be an absolute directory path or a file:///path/ URL")
    return path


def _config_path(value: str, model_dir: Path | None) -> Path:
    if not value:
        raise ValueError("must be a path to an LMCache YAML file")
    path = Path(value)
    if not path.is_absolute():
        if model_dir is None:
            raise ValueError("is relative but no model directory is known; use an absolute path")
        path = model_dir / path
    return path
