"""Check a hand-written LMCache YAML against a host and a model (``lmi-cache validate``).

Run by the CLI process. Findings cover key typos (with a did-you-mean hint),
bad values, sizes that cannot fit RAM or disk times the ranks on this host, and
disk paths that are missing or not writable. The size checks reuse the planner:
the config's sizes become planner overrides, which the planner checks.
Environment ``LMCACHE_*`` overrides are not applied: the file is checked alone.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.plan.types import ModelInfoLike, PlanError, PlanModel
from autoconfig.plan.settings import ServingSettings, TierOverrides
from lmi_cache.errors import ConfigError, UserError

# Planner override name -> the LMCache key it stands for in the file.
_OVERRIDE_KEYS = {
    "lmcache_chunk_size": ("chunk_size", "chunk_size"),
    "lmcache_max_local_cpu_size": ("max_local_cpu_size", "cpu_size_gib"),
    "lmcache_max_local_disk_size": ("max_local_disk_size", "disk_size_gib"),
    "lmcache_local_disk": ("local_disk", "disk_path"),
}


class ValidateInputError(UserError):
    """The config file itself cannot be read (missing, unreadable, not YAML)."""


@dataclass(frozen=True)
class Finding:
    level: str  # "error" or "warning"
    key: str  # the LMCache key concerned, or "settings"
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper():<7} {self.key}: {self.message}"


def validate_config(
    config_path: str,
    model: PlanModel | ModelInfoLike,
    settings: ServingSettings,
    host: HostSnapshot,
    *,
    check_local_paths: bool = True,
) -> list[Finding]:
    """All findings for ``config_path``; errors first. ``check_local_paths``: the host is this machine."""
    from lmi_cache.config.cache_config import config_from_dict

    data = _read(config_path)
    findings = _key_typos(data, config_path)
    known = {k: v for k, v in data.items() if not any(f.key == k for f in findings)}
    try:
        cfg, notes = config_from_dict(known, config_path)
    except ConfigError as err:
        findings.append(Finding("error", _key_in(str(err), known) or "value", str(err)))
        return _sorted(findings)
    findings += [Finding("warning", _key_in(n, known) or "config", n) for n in notes]
    overrides = TierOverrides(
        cpu_size_gib=cfg.max_local_cpu_size if cfg.local_cpu else 0.0,
        disk_size_gib=cfg.max_local_disk_size if cfg.local_disk else 0.0,
        disk_path=cfg.local_disk[0] if cfg.local_disk else None,
        chunk_size=cfg.chunk_size,
        use_odirect=cfg.use_odirect if cfg.local_disk else None,
    )
    if len(cfg.local_disk) > 1:
        findings.append(Finding("warning", "local_disk", f"{len(cfg.local_disk)} paths: sizes are checked "
                                "against the first path's filesystem only"))
    findings += _plan_findings(model, settings, host, overrides)
    if check_local_paths:
        for path in cfg.local_disk:
            findings += _path_findings(path)
    return _sorted(findings)


def blend_findings(config_path: str, model: PlanModel | ModelInfoLike) -> list[Finding]:
    """The file's blending keys: bad values, and a model the blender does not cover (``validate`` only).

    Not part of ``validate_config``: serve checks blending with the environment applied
    (``autoconfig.lmi.blend_options``), where LMCACHE_ENABLE_BLENDING may turn the file's setting off.
    """
    from autoconfig.plan.blend import blend_model_problem
    from lmi_cache.blend.settings import BlendConfigError, BlendSettings, blend_keys_in

    data = _read(config_path)
    keys = blend_keys_in(data)
    try:
        blend = BlendSettings.from_mapping(keys, config_path)
    except BlendConfigError as err:
        return [Finding("error", _key_in(str(err), keys) or "enable_blending", str(err))]
    if not blend.enabled:
        return []
    m = PlanModel.coerce(model)
    problem = blend_model_problem(blend, m.config, m.name, m.layout.num_layers)
    if problem is None:
        return []
    key, line = problem
    return [Finding("error", key, f"{config_path}: enable_blending: true: {line}" if key == "enable_blending" else line)]


def _read(path: str) -> dict[str, Any]:
    from lmi_cache.config.cache_config import read_yaml_mapping

    try:
        data = read_yaml_mapping(path)
    except ConfigError as err:
        raise ValidateInputError(str(err)) from None
    return {str(k): v for k, v in data.items()}


def _key_typos(data: Mapping[str, Any], path: str) -> list[Finding]:
    """Keys no LMCache release defines: errors with a did-you-mean (the engine's own rule, one reader)."""
    from lmi_cache.config.cache_config import unknown_key_problem
    from lmi_cache.config.keys import DEPRECATED_ALIASES, LEGACY_KEYS, LMCACHE_KEYS

    valid = set(LMCACHE_KEYS) | set(DEPRECATED_ALIASES) | set(LEGACY_KEYS)
    out = []
    for key, value in data.items():
        if key not in valid:
            message, is_error = unknown_key_problem(key, value)
            out.append(Finding("error" if is_error else "warning", key, f"{path}: key {key!r}: {message}"))
    return out


def _plan_findings(model: PlanModel | ModelInfoLike, settings: ServingSettings, host: HostSnapshot,
                   overrides: TierOverrides) -> list[Finding]:
    """Plan with the file's sizes as overrides; each PlanError names one key: drop it and retry."""
    from autoconfig.plan.planner import plan_tiers

    out: list[Finding] = []
    for _ in range(len(_OVERRIDE_KEYS) + 1):
        try:
            plan = plan_tiers(host, model, replace(settings, overrides=overrides))
        except PlanError as err:
            message = str(err)
            hit = next((name for name in _OVERRIDE_KEYS if name in message), None)
            if hit is None:
                out.append(Finding("error", "settings", message))
                return out
            key, field_name = _OVERRIDE_KEYS[hit]
            out.append(Finding("error", key, message.replace(hit, key)))
            overrides = replace(overrides, **{field_name: None})
            if field_name == "disk_path":
                overrides = replace(overrides, disk_size_gib=None)
            continue
        for warning in plan.warnings:
            hit = next((name for name in _OVERRIDE_KEYS if name in warning), None)
            key = _OVERRIDE_KEYS[hit][0] if hit else "settings"
            out.append(Finding("warning", key, warning.replace(hit, key) if hit else warning))
        return out
    return out


def _path_findings(path: str) -> list[Finding]:
    """The directory must be one only the serving user controls, existing or creatable (never another user's)."""
    from lmi_cache.private_dir import private_dir_problem

    problem = private_dir_problem(path)
    if problem:
        return [Finding("error", "local_disk", problem)]
    p = Path(path)
    if p.is_dir() and not os.access(p, os.W_OK | os.X_OK):
        return [Finding("error", "local_disk", f"{path} is not writable by this user; fix its permissions")]
    if not p.exists():
        return [Finding("warning", "local_disk", f"{path} does not exist yet; it will be created (mode 0700)")]
    return []


def _key_in(message: str, data: Mapping[str, Any]) -> str | None:
    return next((k for k in sorted(data, key=len, reverse=True) if f"'{k}'" in message or k in message), None)


def _sorted(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: f.level != "error")
