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
- ``option.lmcache_session_retention_share`` 0 to 1: share of the CPU tier where open stateful
  sessions' chunks are evicted last (0 turns it off; default 0.5)
- ``option.lmcache_remote_url``          the fleet's shared store: redis://, rediss://, valkey://,
  valkeys://, unix:// or s3://bucket/prefix (the remote tier behind CPU and disk)
- ``option.lmcache_enable_p2p``          true/false: the peer tier (read a prefix from the server a
  request's router names); with ``option.lmcache_p2p_host``, ``_p2p_init_ports``,
  ``_p2p_lookup_ports`` (one port per rank, e.g. ``8200,8202``; planned when unset)
- ``option.lmcache_peer_holders_url``    a Redis/Valkey where peers find each other's chunks
  without a hint (holder records only, no KV; default: a Redis/Valkey ``lmcache_remote_url``)
- ``option.lmcache_engine``              ``lmi_cache`` (default) or ``lmcache`` (upstream
  LMCache's connector, when that package is installed)
- ``option.lmcache_enable_blending``     true/false: blending in LmiCacheConnector; with
  ``option.lmcache_blend_special_str``, ``_blend_check_layers``, ``_blend_recompute_ratios``,
  ``_blend_min_tokens`` (LMCache's keys; see ``autoconfig.lmi.blend_options``)

LMI's own LMCache recipe (``option.kv_transfer_config`` naming
``LMCacheConnectorV1`` plus ``option.lmcache_config_file`` or the
``LMCACHE_CONFIG_FILE`` environment variable) turns the cache on with that YAML
(auto-configured when no YAML is given); see ``autoconfig.lmi.recipe``.
LMI's simplified environment variables and defaults are in
``autoconfig.lmi.names`` with the pages they follow.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from autoconfig.lmi.blend_options import resolve_blend
from autoconfig.lmi.cache_ways import cache_source
from autoconfig.lmi.java_properties import parse_properties_lines
from autoconfig.lmi.names import SIMPLIFIED_ENV, masked
from autoconfig.lmi.recipe import LmcacheRecipe, find_recipe
from autoconfig.lmi.option_values import (
    abs_dir_path,
    config_path,
    engine_name,
    fraction,
    gib_size,
    lmi_dtype,
    nonempty,
    one_word,
    parse_bool,
    parse_tp,
    positive_int,
    share,
)
from autoconfig.lmi.workers import canonical_name, check_server_keys, default_replicas, lmi_devices, noted, worker_gpus
from autoconfig.plan.settings import ServingSettings, TierOverrides
from lmi_cache.config.peer import holder_records
from lmi_cache.errors import UserError
from lmi_cache.plain_files import PlainFileError, read_text_file

MAX_PROPERTIES_BYTES = 1 << 20  # a serving.properties is a few dozen lines; refuse anything absurd

PROPERTIES_FILE = "serving.properties"
ENV_SOURCE = "environment"
CLI_SOURCE = "command line"  # a flag of ``lmi-cache plan`` / ``validate``: wins over the file and the env
T = TypeVar("T")


class PropertiesError(UserError):
    """A bad value in serving.properties or an OPTION_* variable (names the file/variable and key)."""


@dataclass(frozen=True)
class RawOption:
    name: str  # canonical: lower case, dots -> underscores ("tensor_parallel_degree")
    value: str
    key: str  # as written: "option.tensor_parallel_degree" or "OPTION_TENSOR_PARALLEL_DEGREE"
    source: str  # the serving.properties path, or "environment"
    line: int | None = None  # its line in serving.properties

    @property
    def where(self) -> str:
        """How an error message names this option: the variable, the flag, or the file and line."""
        if self.source == ENV_SOURCE:
            return f"environment variable {self.key}"
        if self.source == CLI_SOURCE:
            return self.key
        return f"{self.source}:{self.line}: {self.key}" if self.line else f"{self.source}: {self.key}"


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
    config_where: str = "option.lmcache_config_file"  # how messages name where config_file came from
    recipe: LmcacheRecipe | None = None  # LMI's kv_transfer_config LMCache recipe, when used
    consumed: frozenset[str] = frozenset()  # options read here that serve must not pass to vLLM
    notes: list[str] = field(default_factory=list)  # defaults applied and translations, for the summary
    devices: list[int] | None = None  # GPUs of LMI's load_on_devices workers: all vLLM may use (None: all)
    tp_is_max: bool = False  # tensor_parallel_degree unset or "max" (serve may fit it to the model's heads)
    env_only: bool = False  # the cache is on through LMCACHE_<KEY> variables alone (autoconfig.lmi.cache_ways)

    @property
    def cache_on(self) -> bool:
        """Whether some way in turns the KV cache on (autoconfig.lmi.cache_ways)."""
        return self.auto_config or self.config_file is not None or self.env_only

    def summary_lines(self) -> list[str]:
        """One line per option with its origin (secrets masked), for the configure log."""
        return [f"{o.name} = {masked(o.name, o.value)}  ({o.where})"
                for o in sorted(self.options.values(), key=lambda o: o.name)]


def collect_options(file_props: Mapping[str, str], source: str, env: Mapping[str, str],
                    cli: Mapping[str, tuple[str, str]] | None = None,
                    notes: list[str] | None = None, lines: Mapping[str, int] | None = None) -> dict[str, RawOption]:
    """Merge ``OPTION_*`` env, ``option.*`` from the file, then command-line flags; later wins.

    The file beats the environment (LMI's rule); a flag (``cli``: the flag as
    written -> (option name, value), e.g. ``{"--tp": ("tensor_parallel_degree", "4")}``,
    see ``autoconfig.cli_inputs``) beats both. Each override is noted once in ``notes``;
    ``lines``: each file key's line, for messages.
    """
    merged: dict[str, RawOption] = {}
    for key, value in env.items():
        if key.startswith("OPTION_") and len(key) > len("OPTION_"):
            if _has_surrogate(key + value):  # bytes that are not UTF-8 (Python keeps them as lone surrogates)
                raise PropertiesError(f"environment variable {key.encode('utf-8', 'replace').decode()}: not UTF-8 "
                                      "text; set it again as UTF-8")
            name = canonical_name(key[len("OPTION_"):])
            merged[name] = RawOption(name, value, key, ENV_SOURCE)
    layers = [(key[len("option."):], key, value, source) for key, value in file_props.items()
              if key.startswith("option.")]
    layers += [(name, flag, value, CLI_SOURCE) for flag, (name, value) in (cli or {}).items()]
    for raw_name, key, value, where in layers:
        name = canonical_name(raw_name)
        old = merged.get(name)
        merged[name] = RawOption(name, value, key, where, (lines or {}).get(key) if where == source else None)
        if old is not None and notes is not None and old.source != where:
            notes.append(f"{merged[name].where} overrides {old.where}")
    return merged


def resolve_properties(
    model_dir: str | Path | None,
    env: Mapping[str, str] | None = None,
    *,
    gpu_count: int | None = None,
    fit_max_tp: Callable[[int], int] | None = None,
    cli: Mapping[str, tuple[str, str]] | None = None,
) -> ResolvedProperties:
    """Read ``<model_dir>/serving.properties`` (if any) and env; type and check every known option.

    ``gpu_count`` resolves ``tensor_parallel_degree=max`` (None: treated as 1 GPU);
    ``fit_max_tp`` lowers that "max" to a degree the model's heads allow (serve knows the model);
    ``cli`` (flag as written -> (option name, value)) are command-line settings, above file and env.
    """
    env = dict(os.environ if env is None else env)
    mdir = Path(model_dir) if model_dir is not None else None
    path = _properties_file(mdir)
    file_props: dict[str, str] = {}
    lines: dict[str, int] = {}
    repeats: list[str] = []
    if path is not None:
        try:
            text = read_text_file(str(path), MAX_PROPERTIES_BYTES)
        except PlainFileError as err:
            raise PropertiesError(f"{path}: {err}; fix its permissions/encoding") from None
        file_props, lines, repeats = parse_properties_lines(text, str(path))
    notes = repeats + check_server_keys(file_props, str(path))
    starts = lmi_devices(file_props, str(path), gpu_count)
    host_gpus = gpu_count or 0
    if starts is not None:
        # Each listed device starts one LMI worker; "max" then means the GPUs up to the next worker's.
        gpu_count = min(b - a for a, b in zip(starts, starts[1:] + [host_gpus]))
    options = collect_options(file_props, str(path), env, cli, notes, lines)
    _apply_env_defaults(options, env, notes)
    get = _Getter(options)

    pp = get.value("pipeline_parallel_degree", positive_int, 1)
    tp = get.value("tensor_parallel_degree", lambda v: parse_tp(v, gpu_count, pp), None)
    tp_is_max = "tensor_parallel_degree" not in options or options["tensor_parallel_degree"].value.strip().lower() == "max"
    if tp is None:
        # LMI's default is "max" (starting-guide.md, TENSOR_PARALLEL_DEGREE): every GPU.
        tp = parse_tp("max", gpu_count, pp)
        if gpu_count:
            notes.append(f"tensor_parallel_degree unset: {tp} (LMI's default 'max': all {gpu_count} GPUs"
                         f"{' / pipeline_parallel_degree' if pp > 1 else ''})")
    if tp_is_max and fit_max_tp is not None and fit_max_tp(tp) != tp:
        notes.append(f"tensor_parallel_degree 'max' is {fit_max_tp(tp)}, not {tp}: the model's attention heads "
                     f"do not split {tp} ways (vLLM would refuse to start)")
        tp = fit_max_tp(tp)
    dp_option = get.value("data_parallel_degree", positive_int, None)
    recipe = find_recipe(options, env, mdir)
    engine = get.value("lmcache_engine", engine_name, "lmi_cache")
    remote_url = _remote_url(options)
    settings = ServingSettings(
        tp=tp,
        pp=pp,
        dp=dp_option or 1,
        gpu_memory_utilization=get.value("gpu_memory_utilization", fraction, 0.9),
        max_model_len=get.value("max_model_len", positive_int, None),
        kv_cache_dtype=get.value("kv_cache_dtype", one_word, "auto"),
        dtype=get.value("dtype", lmi_dtype, "auto"),
        engine=engine,
        overrides=TierOverrides(
            cpu_size_gib=get.value("lmcache_max_local_cpu_size", gib_size, None),
            disk_size_gib=get.value("lmcache_max_local_disk_size", gib_size, None),
            disk_path=get.value("lmcache_local_disk", abs_dir_path, None),
            chunk_size=get.value("lmcache_chunk_size", positive_int, None),
            use_odirect=get.value("lmcache_use_odirect", parse_bool, None),
            remote_url=remote_url,
            session_retention_share=get.value("lmcache_session_retention_share", share, None),
            enable_p2p=get.value("lmcache_enable_p2p", parse_bool, None),
            p2p_host=get.value("lmcache_p2p_host", nonempty, None),
            p2p_init_ports=get.value("lmcache_p2p_init_ports", _ports, None),
            p2p_lookup_ports=get.value("lmcache_p2p_lookup_ports", _ports, None),
            peer_holders=holder_records(_holders_url(options), remote_url),
        ),
    )
    auto = get.value("lmcache_auto_config", parse_bool, False)
    config_file = get.value("lmcache_config_file", lambda v: config_path(v, mdir), None)
    way = cache_source(options, env, mdir, auto, config_file, recipe, engine, notes)
    auto, config_file, config_where = way.auto, way.config_file, way.config_where
    consumed = frozenset({"kv_transfer_config"}) if recipe is not None else frozenset()
    if dp_option is None:
        workers = host_gpus if starts is None else len(starts) * tp * pp
        dp = default_replicas(tp * pp, workers, way.on, file_props, notes)
        settings = replace(settings, dp=dp)
    devices = None
    if starts is not None:
        devices = worker_gpus(starts[:settings.dp], tp * pp, host_gpus, str(path))
    if engine == "lmcache" and options["lmcache_engine"].source != CLI_SOURCE:
        # plan --engine lmcache is a what-if for an image that has LMCache, not this one.
        _check_upstream_lmcache(options["lmcache_engine"].where)
    blend, blend_where = resolve_blend(options, env, config_file, config_where or "option.lmcache_config_file", engine)
    settings = replace(settings, blend=blend, blend_where=blend_where)
    model_id = get.value("model_id", nonempty, None)
    others = {k: v for k, v in file_props.items() if not k.startswith("option.") and not noted(k, notes)}
    return ResolvedProperties(mdir, path, model_id, auto, config_file, settings, options, others,
                              config_where or "option.lmcache_config_file", recipe, consumed, notes, devices,
                              tp_is_max, way.env_only)


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def _properties_file(mdir: Path | None) -> Path | None:
    """``<mdir>/serving.properties`` when it is a file; a directory or a link to nowhere is an error, not "none"."""
    if mdir is None:
        return None
    path = mdir / PROPERTIES_FILE
    if path.is_file():
        return path
    if path.is_dir():
        raise PropertiesError(f"{path}: is a directory, not a properties file; remove it or put the settings in a "
                              "file of that name")
    if path.is_symlink():  # exists() follows the link: false for a loop or a missing target
        raise PropertiesError(f"{path}: a symbolic link that leads to no file (a loop or a missing target); "
                              "point it at the properties file or remove it")
    return None


def _apply_env_defaults(options: dict[str, RawOption], env: Mapping[str, str], notes: list[str]) -> None:
    """LMI's simplified variables (HF_MODEL_ID, TENSOR_PARALLEL_DEGREE, SM_NUM_GPUS, ...) fill options only when unset.

    One that an option overrides is noted, as an overridden ``OPTION_*`` variable is.
    """
    for var, name in SIMPLIFIED_ENV:
        if not env.get(var, "").strip():
            continue
        if name not in options:
            options[name] = RawOption(name, env[var].strip(), var, ENV_SOURCE)
        elif var != "SM_NUM_GPUS" and options[name].source != ENV_SOURCE and \
                env[var].strip() != options[name].value.strip():  # SM_NUM_GPUS: SageMaker's count, not a choice
            notes.append(f"{options[name].where} overrides environment variable {var}")


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


def _ports(value: str) -> tuple[int, ...]:
    """One port per rank: ``8200`` or ``8200,8202``."""
    from lmi_cache.config.peer import parse_ports
    from lmi_cache.errors import ConfigError

    try:
        return parse_ports(value, "ports")
    except ConfigError as err:
        raise ValueError(str(err).removeprefix("ports: ")) from None


def _remote_url(options: Mapping[str, RawOption]) -> str | None:
    """option.lmcache_remote_url, checked; errors never echo the URL (it can hold a password)."""
    opt = options.get("lmcache_remote_url")
    if opt is None or not opt.value.strip():
        return None
    from lmi_cache.errors import ConfigError
    from lmi_cache.remote.url import parse_remote_url

    try:
        parse_remote_url(opt.value.strip()).store_kind()
    except ConfigError as err:
        raise PropertiesError(f"{opt.where}: {err}") from None
    return opt.value.strip()


def _holders_url(options: Mapping[str, RawOption]) -> str | None:
    """option.lmcache_peer_holders_url, checked as the engine checks it; errors never echo the URL."""
    opt = options.get("lmcache_peer_holders_url")
    if opt is None or not opt.value.strip():
        return None
    from lmi_cache.config.peer import parse_holders_url
    from lmi_cache.errors import ConfigError

    try:
        return parse_holders_url(opt.value.strip(), opt.where)
    except ConfigError as err:
        raise PropertiesError(str(err)) from None


def _check_upstream_lmcache(where: str) -> None:
    import importlib.util

    if importlib.util.find_spec("lmcache") is None:
        raise PropertiesError(f"{where}=lmcache: the lmcache package is not installed in this image; "
                              "install it, or remove the option to use lmi-cache's own connector")


