"""Every documented way in turns the cache on, or stops with one line saying why (serve --dry-run, plan)."""
from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from cli_helpers import one_line_error
from click.testing import CliRunner, Result

from autoconfig.cli import main

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "fixtures" / "hf_configs" / "llama-3.1-8b-instruct"
YAML = "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 4\n"


def model_dir(tmp_path: Path, properties: str, yaml: str | None = None) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir(parents=True)
    shutil.copy(MODEL / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text("option.max_model_len=8192\n" + properties)
    if yaml is not None:
        (mdir / "lmcache.yaml").write_text(yaml)
    return mdir


def serve(mdir: Path, tmp_path: Path, **env: str) -> Result:
    return CliRunner().invoke(main, ["serve", "--dry-run", "--model-dir", str(mdir), "--instance-type", "ml.g6e.xlarge"],
                              env={"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "runtime"), **env})


def connector(result: Result) -> str | None:
    argv = shlex.split(next(ln for ln in result.stdout.splitlines() if ln.startswith("exec: "))[6:])
    if "--kv-transfer-config" not in argv:
        return None
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector"]


def cache_line(result: Result) -> str:
    return next(ln for ln in result.stdout.splitlines() if ": cache: " in ln).split(": cache: ", 1)[1]


def test_lmcache_config_file_alone_turns_the_cache_on(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "", YAML)
    result = serve(mdir, tmp_path, LMCACHE_CONFIG_FILE=str(mdir / "lmcache.yaml"))
    assert result.exit_code == 0, result.output
    assert connector(result) == "LmiCacheConnector"
    assert cache_line(result) == f"LMCache config from {mdir / 'lmcache.yaml'} (CPU tier 4.00 GiB/rank; disk tier off; chunk 256 tokens)"
    assert "note: cache on: environment variable LMCACHE_CONFIG_FILE" in result.stdout


def test_lmcache_config_file_alone_relative_to_the_model_dir(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "", YAML)
    result = serve(mdir, tmp_path, LMCACHE_CONFIG_FILE="lmcache.yaml")
    assert result.exit_code == 0 and connector(result) == "LmiCacheConnector", result.output


def test_lmcache_config_file_alone_that_does_not_exist_stops(tmp_path: Path) -> None:
    one_line_error(serve(model_dir(tmp_path, ""), tmp_path, LMCACHE_CONFIG_FILE="/nowhere/lmcache.yaml"),
                   "environment variable LMCACHE_CONFIG_FILE", "/nowhere/lmcache.yaml does not exist")


def test_lmcache_variables_alone_turn_the_cache_on(tmp_path: Path) -> None:
    result = serve(model_dir(tmp_path, ""), tmp_path, LMCACHE_CHUNK_SIZE="512", LMCACHE_MAX_LOCAL_CPU_SIZE="3")
    assert result.exit_code == 0, result.output
    assert connector(result) == "LmiCacheConnector"
    assert cache_line(result) == "from LMCACHE_* variables (CPU tier 3.00 GiB/rank; disk tier off; chunk 512 tokens)"
    assert "LMCACHE_CONFIG_FILE" not in result.stdout  # no YAML: the engine reads the variables


def test_lmcache_variables_alone_with_a_bad_value_stop(tmp_path: Path) -> None:
    one_line_error(serve(model_dir(tmp_path, ""), tmp_path, LMCACHE_CHUNK_SIZE="abc"), "LMCACHE_CHUNK_SIZE")


def test_option_lmcache_config_file(tmp_path: Path) -> None:
    result = serve(model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n", YAML), tmp_path)
    assert result.exit_code == 0 and connector(result) == "LmiCacheConnector", result.output
    assert cache_line(result).startswith("LMCache config from")


def test_option_config_file_beats_the_variable_and_says_so(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n", YAML)
    other = tmp_path / "other.yaml"
    other.write_text(YAML)
    result = serve(mdir, tmp_path, LMCACHE_CONFIG_FILE=str(other))
    assert result.exit_code == 0, result.output
    assert "option.lmcache_config_file overrides environment variable LMCACHE_CONFIG_FILE" in result.stdout
    assert f"env LMCACHE_CONFIG_FILE={mdir / 'lmcache.yaml'}" in result.stdout


@pytest.mark.parametrize("yaml", [YAML, None], ids=["with-yaml", "auto"])
def test_lmis_recipe(yaml: str | None, tmp_path: Path) -> None:
    recipe = 'option.kv_transfer_config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}\n'
    mdir = model_dir(tmp_path, recipe, yaml)
    env = {"LMCACHE_CONFIG_FILE": str(mdir / "lmcache.yaml")} if yaml else {}
    result = serve(mdir, tmp_path, **env)
    assert result.exit_code == 0 and connector(result) == "LmiCacheConnector", result.output
    assert cache_line(result).startswith("LMCache config from" if yaml else "auto-configured")


def test_option_auto_config(tmp_path: Path) -> None:
    result = serve(model_dir(tmp_path, "option.lmcache_auto_config=true\n"), tmp_path)
    assert result.exit_code == 0 and connector(result) == "LmiCacheConnector", result.output
    assert cache_line(result).startswith("auto-configured (CPU tier")


def test_auto_config_and_the_variable_together_stop(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_auto_config=true\n", YAML)
    one_line_error(serve(mdir, tmp_path, LMCACHE_CONFIG_FILE=str(mdir / "lmcache.yaml")),
                   "option.lmcache_auto_config=true and environment variable LMCACHE_CONFIG_FILE", "choose one")


@pytest.mark.parametrize("line", ["option.lmcache_max_local_cpu_size=60", "option.lmcache_remote_url=redis://h:6379",
                                  "option.lmcache_local_disk=/mnt/nvme/kv", "option.lmcache_enable_blending=true"])
def test_cache_options_without_a_way_in_are_an_error(line: str, tmp_path: Path) -> None:
    name = line.split("=")[0]
    for command in (["serve", "--dry-run"], ["plan"]):
        mdir = model_dir(tmp_path / command[0], line + "\n")
        result = CliRunner().invoke(main, [*command, "--model-dir", str(mdir), "--instance-type", "ml.g6e.xlarge"],
                                    env={"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "runtime")})
        one_line_error(result, name, "which nothing turns on", "add option.lmcache_auto_config=true")


def test_planned_summary_shows_what_an_lmcache_variable_changes(tmp_path: Path) -> None:
    result = serve(model_dir(tmp_path, "option.lmcache_auto_config=true\n"), tmp_path, LMCACHE_CHUNK_SIZE="512")
    assert result.exit_code == 0, result.output
    line = cache_line(result)
    assert "chunk 512 tokens (LMCACHE_CHUNK_SIZE; planned: chunk 256 tokens)" in line, line
    said = [ln for ln in result.stdout.splitlines() if "LMCACHE_CHUNK_SIZE" in ln and "override" in ln]
    assert len(said) == 1  # reported once
