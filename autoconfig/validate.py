"""Check a hand-written LMCache YAML against a host and a model (``lmi-cache validate``).

Run by the CLI process (``validate``) and at container start (``serve``, for a
user's YAML or ``LMCACHE_*`` variables alone). Findings cover key typos (with a
did-you-mean hint), bad values (every one of them, not the first), sizes that
cannot fit RAM or disk times the ranks on this host, and disk paths that are
missing or not writable. The size checks reuse the planner: the settings the
server will read (the file with ``LMCACHE_<KEY>`` variables on top, LMCache's
rule) become planner overrides, which the planner checks; each message names
the file key or the variable that set the value.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.plan.types import ModelInfoLike, PlanError, PlanModel, TierPlan
from autoconfig.plan.settings import ServingSettings, TierOverrides
from autoconfig.plan.tier_labels import TIER_SETTINGS, lmcache_labels, named_setting, overrides_of, relabel, relabel_plan
from lmi_cache.errors import ConfigError, UserError


class ValidateInputError(UserError):
    """The config file itself cannot be read (missing, unreadable, not YAML)."""


@dataclass(frozen=True)
class Finding:
    level: str  # "error" or "warning"
    key: str  # the LMCache key concerned, or "settings"
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper():<7} {self.key}: {self.message}"


def validate_config(config_path: str | None, model: PlanModel | ModelInfoLike, settings: ServingSettings,
                    host: HostSnapshot, **options: Any) -> list[Finding]:
    """All findings for ``config_path``, errors first (``checked_tiers`` without the plan; same options)."""
    return checked_tiers(config_path, model, settings, host, **options)[0]


def checked_tiers(
    config_path: str | None,
    model: PlanModel | ModelInfoLike,
    settings: ServingSettings,
    host: HostSnapshot,
    *,
    check_local_paths: bool = True,
    env: Mapping[str, str] | None = None,
    planned: Mapping[str, Any] | None = None,
) -> tuple[list[Finding], "TierPlan | None"]:
    """The findings for ``config_path`` (None: ``LMCACHE_*`` alone) with ``env``'s ``LMCACHE_<KEY>`` on top,
    errors first, and the tiers the server will run (None when any finding is an error).

    ``check_local_paths``: the host is this machine. ``planned``: auto-configuration's LMCache
    mapping, read in place of a file (``config_path`` names it).
    """
    from lmi_cache.config.cache_config import config_with_env

    data = dict(planned) if planned is not None else _read(config_path) if config_path is not None else {}
    source = config_path or "environment"
    findings = _key_typos(data, source)
    known = {k: v for k, v in data.items() if not any(f.key == k for f in findings)}
    findings += _value_errors(known, source)
    known = {k: v for k, v in known.items() if not any(f.key == k for f in findings)}
    lmcache_env = {k: v for k, v in (env or {}).items() if k.startswith("LMCACHE_")}
    try:
        cfg, notes = config_with_env(known if config_path is not None else None, lmcache_env, source)
    except ConfigError as err:  # a bad variable: reported by the caller's environment check; check the file alone
        if not lmcache_env:
            findings.append(Finding("error", _key_in(str(err), known) or "value", str(err)))
            return _sorted(findings), None
        lmcache_env = {}
        cfg, notes = config_with_env(known if config_path is not None else None, {}, source)
    findings += [Finding("warning", _key_in(n, known) or "config", n) for n in notes]
    if len(cfg.local_disk) > 1:
        findings.append(Finding("warning", "local_disk", f"{len(cfg.local_disk)} paths: sizes are checked "
                                "against the first path's filesystem only"))
    labels = lmcache_labels(data if config_path is not None else None, source, lmcache_env)
    from autoconfig.serve.configure import cpu_kvcache_space_from_env

    space_gib = cpu_kvcache_space_from_env(env or {})  # vLLM's CPU KV pool, as the planner of serve sizes it
    sized, plan = _plan_findings(model, replace(settings, overrides=overrides_of(cfg)), host, labels, space_gib)
    findings += sized
    if check_local_paths:
        for path in cfg.local_disk:
            findings += _path_findings(path)
    errors = any(f.level == "error" for f in findings)
    return _sorted(findings), None if errors else plan


def _value_errors(data: Mapping[str, Any], source: str) -> list[Finding]:
    """Each key whose value LMCache's reader refuses: one finding per key, so one run shows them all."""
    from lmi_cache.config.cache_config import config_from_dict

    out = []
    for key, value in data.items():
        try:
            config_from_dict({key: value}, source)
        except ConfigError as err:
            out.append(Finding("error", key, str(err)))
    if out:
        return out
    try:  # keys that are only wrong together (a remote URL and its extra_config)
        config_from_dict(data, source)
    except ConfigError as err:
        out.append(Finding("error", _key_in(str(err), data) or "value", str(err)))
    return out


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
                   labels: dict[str, str], space_gib: int | None) -> tuple[list[Finding], "TierPlan | None"]:
    """Plan with the config's sizes as overrides; each PlanError names one setting: drop it and retry.

    The plan comes back when every override was taken as given (the tiers the server runs).
    """
    from autoconfig.plan.planner import plan_tiers

    out: list[Finding] = []
    overrides = settings.overrides
    for _ in range(len(TIER_SETTINGS) + 1):
        try:
            plan = plan_tiers(host, model, replace(settings, overrides=overrides), cpu_kvcache_space_gib=space_gib)
        except PlanError as err:
            message = str(err)
            hit = named_setting(message)
            if hit is None:
                out.append(Finding("error", "settings", message))
                return out, None
            key, field_name = TIER_SETTINGS[hit]
            out.append(Finding("error", key, relabel(message, labels)))
            overrides = replace(overrides, **{field_name: None})
            if field_name == "disk_path":
                overrides = replace(overrides, disk_size_gib=None)
            continue
        for warning in plan.warnings:
            hit = named_setting(warning)
            out.append(Finding("warning", TIER_SETTINGS[hit][0] if hit else "settings", relabel(warning, labels)))
        return out, None if any(f.level == "error" for f in out) else relabel_plan(plan, labels)
    return out, None


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
