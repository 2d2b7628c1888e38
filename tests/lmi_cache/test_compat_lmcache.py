"""The LMCache compatibility suite: real public LMCache YAML files and CI environments behave as their authors expect.

Each file under tests/fixtures/compat/lmcache/ is verbatim from LMCache's (or
LMI's) repository, with its source in SOURCES.md and its expected outcome in
expected.yaml: accepted with exactly the engine values LMCache would use and a
one-line warning for everything lmi-cache does differently, or refused with one
line. ``validate`` is run on each against the LMI target host (catalog
ml.p4d.24xlarge), as a user migrating would run it first.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from autoconfig.probe.catalog import host_snapshot_for
from autoconfig.model.source import load_model_info
from autoconfig.plan.settings import ServingSettings
from autoconfig.validate import validate_config
from lmi_cache.config.cache_config import load_config
from lmi_cache.errors import ConfigError

COMPAT = Path(__file__).resolve().parents[1] / "fixtures" / "compat" / "lmcache"
EXPECTED: dict[str, Any] = yaml.safe_load((COMPAT / "expected.yaml").read_text())
FILES = sorted(p.name for p in COMPAT.glob("*.yaml") if p.name != "expected.yaml")
ENV_FILES = sorted(f"env/{p.name}" for p in (COMPAT / "env").glob("*.yaml"))
LLAMA8B = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs" / "llama-3.1-8b-instruct"


def test_suite_is_complete_and_sourced() -> None:
    assert set(EXPECTED) == set(FILES) | set(ENV_FILES), "every file needs an expected outcome, and vice versa"
    sources = (COMPAT / "SOURCES.md").read_text()
    for name in FILES + ENV_FILES:
        assert f"`{name}`" in sources, f"{name} has no source in SOURCES.md"
    from_lmcache = [line for line in sources.splitlines() if "| LMCache/LMCache |" in line]
    assert len(from_lmcache) >= 15


def _check_config(config: Any, expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        actual = getattr(config, key)
        assert (list(actual) if isinstance(actual, tuple) else actual) == value, key


def _check_warnings(warnings: list[str], expected: list[str]) -> None:
    assert all("\n" not in w for w in warnings)
    for needle in expected:
        assert any(needle in w for w in warnings), f"no warning contains {needle!r}: {warnings}"
    if not expected:
        assert warnings == []


@pytest.mark.parametrize("name", FILES)
def test_real_lmcache_file(name: str) -> None:
    expected = EXPECTED[name]
    path = str(COMPAT / name)
    if expected["outcome"] == "refused":
        with pytest.raises(ConfigError) as info:
            load_config(path, env={})
        assert expected["error"] in str(info.value) and "\n" not in str(info.value)
        return
    config, warnings = load_config(path, env={})
    _check_config(config, expected["config"])
    _check_warnings(warnings, expected["warnings"])
    for secret in expected.get("secrets_not_printed", []):
        assert not any(secret in w for w in warnings)


@pytest.fixture(scope="module")
def target() -> tuple[Any, Any]:
    return host_snapshot_for("ml.p4d.24xlarge", model_bytes_on_disk=16 << 30), load_model_info(str(LLAMA8B))


@pytest.mark.parametrize("name", FILES)
def test_validate_real_lmcache_file(name: str, target: tuple[Any, Any]) -> None:
    host, model = target
    findings = validate_config(str(COMPAT / name), model, ServingSettings(tp=1), host, check_local_paths=False)
    errors = sorted(f.key for f in findings if f.level == "error")
    expected = EXPECTED[name]["validate"]
    assert errors == ([] if expected == "clean" else sorted(expected)), [str(f) for f in findings]


@pytest.mark.parametrize("name", ENV_FILES)
def test_lmcache_ci_environments(name: str) -> None:
    workload = yaml.safe_load((COMPAT / name).read_text())
    for section, expected in EXPECTED[name].items():
        env = dict(item.partition("=")[::2] for item in workload[section]["env"])
        config, warnings = load_config(env=env)
        _check_config(config, expected["config"])
        _check_warnings(warnings, expected["warnings"])


# LMCache's own environment-parsing expectations, from its config tests
# (LMCache/LMCache tests/v1/test_config.py at 0a01ad02811580f9b30069a7e35349442777b4ea):
# surrounding spaces and one pair of quotes are dropped, quoted JSON is a mapping.
@pytest.mark.parametrize(
    "raw, expected",
    [
        ('  {"test_key": "test_value", "number": 42}  ', {"test_key": "test_value", "number": 42}),
        ('\'{"nested": {"key": "value"}}\'', {"nested": {"key": "value"}}),
        ('"{\\"config\\": \\"prod\\"}"', {"config": "prod"}),
    ],
)
def test_extra_config_env_forms_from_lmcache_tests(raw: str, expected: dict[str, Any]) -> None:
    from lmi_cache.config.values import parse_mapping

    assert parse_mapping(raw, "env LMCACHE_EXTRA_CONFIG") == expected
    load_config(env={"LMCACHE_EXTRA_CONFIG": raw})  # accepted by the engine's loader too


def test_scalar_env_forms_from_lmcache_tests() -> None:
    from lmi_cache.config.values import unquote_env

    config, _ = load_config(env={"LMCACHE_CHUNK_SIZE": "  512  "})
    assert config.chunk_size == 512
    assert unquote_env("'http://example.com:8080'") == "http://example.com:8080"
    assert unquote_env('"sender"') == "sender" and unquote_env("' ### '") == " ### "
    # LMCache keeps its default for a value it cannot parse (a silent change); lmi-cache refuses it.
    with pytest.raises(ConfigError, match="LMCACHE_CHUNK_SIZE"):
        load_config(env={"LMCACHE_CHUNK_SIZE": "invalid_number"})
