"""The summary ``lmi-cache serve`` prints before it starts vLLM (container-start process).

It must be true: the cache line shows the values the server will read, so a
``LMCACHE_<KEY>`` variable that overrides the planned YAML shows its value (and
the planned one it replaces), and LMCACHE_* variables alone show what they set.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from autoconfig.lmi.names import SERVER_KEYS_USED, is_secret_env, masked
from autoconfig.lmi.properties import ResolvedProperties

if TYPE_CHECKING:
    from autoconfig.plan.types import TierPlan
    from lmi_cache.config.cache_config import CacheConfig

GIB = 1 << 30


def serve_summary(props: ResolvedProperties, mode: str, model: str, address: tuple[str, int], mapped_notes: list[str],
                  messages: list[str], findings: list[str], env_set: Mapping[str, str],
                  plans: "tuple[TierPlan | None, TierPlan | None]", env: Mapping[str, str]) -> list[str]:
    """``plans``: the tiers that will run, and what auto-configuration would size instead (None: not shown)."""
    s = props.settings
    lines = [f"model: {model}",
             f"parallel: tp={s.tp} pp={s.pp} dp={s.dp}; max_model_len={s.max_model_len or 'model default'}; "
             f"dtype={s.dtype}; kv_cache_dtype={s.kv_cache_dtype}"]
    for name, opt in sorted(props.options.items()):
        lines.append(f"option {name} = {masked(name, opt.value)}  ({opt.where})")
    lines += [f"note: {n}" for n in props.notes + mapped_notes]
    lines += [f"note: {key}={value} in {props.properties_path}: " + (SERVER_KEYS_USED[key] if key in SERVER_KEYS_USED
              else "ignored: this container always runs vLLM's OpenAI server")
              for key, value in sorted(props.other_properties.items())]
    lines += cache_lines(mode, props, plans[0], env)
    if plans[1] is not None:
        lines.append(f"cache: auto-configuration would size instead: {'; '.join(planned_parts(plans[1]))}")
    lines += [m for m in messages if m.startswith("warning:")]
    lines += [f"config check: {f}" for f in findings]
    lines += [f"env {k}={'***' if is_secret_env(k) else v}" for k, v in sorted(env_set.items())]
    lines.append(f"vLLM OpenAI server on {address[0]}:{address[1]} (/ping, /invocations)")
    return lines


def cache_lines(mode: str, props: ResolvedProperties, plan: "TierPlan | None", env: Mapping[str, str]) -> list[str]:
    lines = [_tier_line(mode, props, plan, env)]
    if mode != "off" and props.settings.blend_connector:
        b = props.settings.blend
        lines.append(f"cache: blending on ({props.settings.blend_where}): LmiCacheConnector, separator "
                     f"{b.special_str!r}, recompute ratios {list(b.recompute_ratios)} after layers {list(b.check_layers)}")
    return lines


def _tier_line(mode: str, props: ResolvedProperties, plan: "TierPlan | None", env: Mapping[str, str]) -> str:
    from lmi_cache.config.cache_config import config_with_env
    from lmi_cache.config.env import env_override_names

    if mode == "off":
        return "cache: off (set option.lmcache_auto_config=true or option.lmcache_config_file to enable)"
    if mode in ("file", "env"):
        parts = planned_parts(plan) if plan is not None else _parts(_user_config(props, env))
        checked = "" if plan is not None else "; sizes not checked: config.json not readable now"
        where = f"LMCache config from {props.config_file}" if mode == "file" else "from LMCACHE_* variables"
        return f"cache: {where} ({'; '.join(parts)}{checked})"
    if plan is None:
        cfg, _ = config_with_env(None, env, "environment")
        return f"cache: from LMCACHE_* variables ({'; '.join(_parts(cfg))})"
    parts = planned_parts(plan)
    if env_override_names(env):
        cfg, _ = config_with_env(plan.lmcache_config, env, "the planned YAML")
        for i, (names, mine) in enumerate(zip(_PART_VARS, _parts(cfg))):
            given = [n for n in names if n in env]
            if given and mine != parts[i]:
                parts[i] = f"{mine} ({', '.join(given)}; planned: {parts[i]})"
    return f"cache: auto-configured ({'; '.join(parts)})"


def _user_config(props: ResolvedProperties, env: Mapping[str, str]) -> "CacheConfig":
    """The user's YAML (if any) with LMCACHE_* on top, as the engine reads it (already checked by configure)."""
    from lmi_cache.config.cache_config import config_with_env, read_yaml_mapping

    data = read_yaml_mapping(str(props.config_file)) if props.config_file is not None else None
    return config_with_env(data, env, str(props.config_file or "environment"))[0]


def planned_parts(plan: "TierPlan") -> list[str]:
    cpu, disk = plan.cpu, plan.disk
    return [f"CPU tier {cpu.bytes_per_rank / GIB:.2f} GiB/rank" if cpu.enabled else "CPU tier off",
            f"disk tier {disk.bytes_per_rank / GIB:.2f} GiB/rank at {disk.path}" if disk.enabled else "disk tier off",
            f"chunk {plan.chunk_size} tokens",
            *([f"peer tier {plan.peer.summary()}"] if plan.peer is not None else [])]


def _parts(cfg: "CacheConfig") -> list[str]:
    """The same parts, from the settings the engine will read."""
    on_disk = cfg.local_disk and cfg.max_local_disk_size > 0
    return [f"CPU tier {cfg.max_local_cpu_size:.2f} GiB/rank" if cfg.local_cpu and cfg.max_local_cpu_size > 0
            else "CPU tier off",
            f"disk tier {cfg.max_local_disk_size:.2f} GiB/rank at {','.join(cfg.local_disk)}" if on_disk
            else "disk tier off",
            f"chunk {cfg.chunk_size} tokens",
            *([_peer_part(cfg)] if cfg.enable_p2p else [])]


def _peer_part(cfg: "CacheConfig") -> str:
    from autoconfig.plan.peer import holders_text
    from lmi_cache.config.peer import DEFAULT_INIT_PORT, holder_records

    ports = (f"ports {list(cfg.p2p_init_ports)} / {list(cfg.p2p_lookup_ports)}" if cfg.p2p_init_ports
             else f"ports {DEFAULT_INIT_PORT} + 2 x rank")
    return (f"peer tier on at {cfg.p2p_host or '127.0.0.1'}, {ports}, over {cfg.peer_transport}; "
            f"{holders_text(holder_records(cfg.peer_holders_url, cfg.remote_url))}")


# The variables behind each part of the cache line, in _parts' order.
_PART_VARS = (("LMCACHE_LOCAL_CPU", "LMCACHE_MAX_LOCAL_CPU_SIZE"), ("LMCACHE_LOCAL_DISK", "LMCACHE_MAX_LOCAL_DISK_SIZE"),
              ("LMCACHE_CHUNK_SIZE",))
