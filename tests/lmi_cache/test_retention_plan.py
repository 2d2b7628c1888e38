"""The planned share of the CPU tier for open stateful sessions: option, plan row, YAML key, engine config."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from autoconfig.plan.planner import plan_tiers
from autoconfig.lmi.properties import PropertiesError, resolve_properties
from autoconfig.render.plan_text import format_plan
from autoconfig.plan.settings import ServingSettings, TierOverrides
from lmi_cache.config.cache_config import config_from_dict
from lmi_cache.errors import ConfigError
from tests.autoconfig.plan_helpers import LLAMA8B, host


def _plan(share: float | None = None, engine: str = "lmi_cache"):  # type: ignore[no-untyped-def]
    settings = ServingSettings(engine=engine, overrides=TierOverrides(session_retention_share=share))
    return plan_tiers(host(1, 200), LLAMA8B, settings)


def test_default_plan_keeps_half_the_cpu_tier_for_open_sessions() -> None:
    plan = _plan()
    assert plan.cpu.session_retention_share == 0.5
    assert plan.cpu.session_retention_bytes_per_rank == plan.cpu.bytes_per_rank // 2
    assert plan.lmcache_config["extra_config"]["session_retention_share"] == 0.5
    assert plan.to_dict()["tiers"]["cpu"]["session_retention_bytes_per_rank"] == plan.cpu.bytes_per_rank // 2
    assert any(line.startswith("session_retention_share = 0.5 (the default") for line in plan.explanation)
    assert "Session retention    up to " in format_plan(plan, "test")
    cfg, warnings = config_from_dict(plan.lmcache_config, "plan")
    assert warnings == [] and cfg.session_retention_share == 0.5


def test_the_option_sets_or_turns_off_the_share() -> None:
    plan = _plan(0.25)
    assert plan.lmcache_config["extra_config"]["session_retention_share"] == 0.25
    off = _plan(0.0)
    # Written as 0, not left out: the engine's own default is on.
    assert off.lmcache_config["extra_config"]["session_retention_share"] == 0.0
    assert "Session retention    off" in format_plan(off, "test")
    assert config_from_dict(off.lmcache_config, "plan")[0].session_retention_share == 0.0


def test_upstream_lmcache_gets_no_share_and_a_warning_when_asked() -> None:
    plan = _plan(0.3, engine="lmcache")
    assert "session_retention_share" not in plan.lmcache_config["extra_config"]
    assert any("lmcache_session_retention_share=0.3 ignored" in w for w in plan.warnings)


def test_no_cpu_tier_no_share() -> None:
    settings = ServingSettings(overrides=TierOverrides(cpu_size_gib=0.0))
    plan = plan_tiers(host(1, 200), LLAMA8B, settings)
    assert plan.cpu.session_retention_share == 0.0 and "session_retention_share" not in plan.lmcache_config["extra_config"]


def test_serving_properties_option(tmp_path: Path) -> None:
    (tmp_path / "serving.properties").write_text("option.lmcache_session_retention_share=0.2\n")
    assert resolve_properties(tmp_path, {}).settings.overrides.session_retention_share == 0.2
    env = {"OPTION_LMCACHE_SESSION_RETENTION_SHARE": "0"}
    assert resolve_properties(tmp_path / "none", env).settings.overrides.session_retention_share == 0.0
    for bad in ("1.5", "-0.1", "half"):
        (tmp_path / "serving.properties").write_text(f"option.lmcache_session_retention_share={bad}\n")
        with pytest.raises(PropertiesError, match="from 0 to 1"):
            resolve_properties(tmp_path, {})


def test_share_follows_the_planned_tier_size() -> None:
    plan = _plan(0.5)
    smaller = replace(plan.cpu, bytes_per_rank=plan.cpu.bytes_per_rank // 4)
    assert smaller.session_retention_bytes_per_rank == smaller.bytes_per_rank // 2


def test_engine_config_reads_and_checks_the_share() -> None:
    assert config_from_dict({}, "cfg")[0].session_retention_share == 0.5
    cfg, warnings = config_from_dict({"extra_config": {"session_retention_share": "0.2"}}, "cfg")
    assert cfg.session_retention_share == 0.2 and warnings == []
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(ConfigError, match="extra_config.session_retention_share': expected a share of the CPU tier from 0"):
            config_from_dict({"extra_config": {"session_retention_share": bad}}, "cfg")


def test_the_option_is_read_by_the_planner_not_passed_to_vllm() -> None:
    from autoconfig.lmi.to_vllm import map_lmi_options

    mapped = map_lmi_options({"lmcache_session_retention_share": "0.3", "max_model_len": "4096"})
    assert "session" not in repr(mapped)
