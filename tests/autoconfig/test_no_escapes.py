"""Inputs that used to escape as tracebacks or hangs are one line, exit 2, within a second; flags get a did-you-mean."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from cli_helpers import one_line_error
from click.testing import CliRunner, Result

from autoconfig.cli import main

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "fixtures" / "hf_configs" / "llama-3.1-8b-instruct"
HOST = REPO / "tests" / "fixtures" / "hosts" / "a100x8_nvme_cgroup.json"
BOMB = "".join(f"  {k}: &{k} [{', '.join([prev] * 9)}]\n" for k, prev in zip(
    "abcdefghi", ['"lol"'] + [f"*{c}" for c in "abcdefgh"]))


def invoke(args: list[str], tmp_path: Path, **env: str) -> tuple[Result, float]:
    start = time.monotonic()
    result = CliRunner().invoke(main, args, env={"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "rt"), **env})
    return result, time.monotonic() - start


def model_dir(tmp_path: Path, properties: str) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir()
    shutil.copy(MODEL / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text(properties, encoding="utf-8")
    return mdir


@pytest.mark.parametrize("line", ["option.model_id=\\ud800", "engine=\\ud800",
                                  "option.lmcache_auto_config=true\noption.lmcache_local_disk=/x\\udfff"])
def test_a_lone_surrogate_escape_in_serving_properties(line: str, tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, line + "\n")
    result, took = invoke(["serve", "--dry-run", "--model-dir", str(mdir), "--host-snapshot", str(HOST)], tmp_path)
    one_line_error(result, "serving.properties", "without its other half")
    assert took < 1.0


def test_a_surrogate_pair_escape_is_one_character(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=8192\noption.served_model_name=m\\ud83d\\ude00\n")
    result, _ = invoke(["serve", "--dry-run", "--model-dir", str(mdir), "--host-snapshot", str(HOST)], tmp_path)
    assert result.exit_code == 0, result.output
    assert "m\U0001f600" in result.stdout


def test_an_option_variable_that_is_not_utf8(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=8192\n")
    result, _ = invoke(["serve", "--dry-run", "--model-dir", str(mdir), "--host-snapshot", str(HOST)], tmp_path,
                       OPTION_SERVED_MODEL_NAME="bad\udcff")
    one_line_error(result, "environment variable OPTION_SERVED_MODEL_NAME", "not UTF-8")


@pytest.mark.parametrize("command", [["validate", "{yaml}", "--model", str(MODEL), "--host-snapshot", str(HOST)],
                                     ["serve", "--dry-run", "--model-dir", "{mdir}", "--host-snapshot", str(HOST)]],
                         ids=["validate", "serve"])
def test_an_alias_bomb_in_extra_config(command: list[str], tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=8192\noption.lmcache_config_file=lmcache.yaml\n")
    (mdir / "lmcache.yaml").write_text("chunk_size: 256\nextra_config:\n" + BOMB + "  disk_feed: *i\n")
    args = [a.format(yaml=mdir / "lmcache.yaml", mdir=mdir) for a in command]
    result, took = invoke(args, tmp_path)
    one_line_error(result, "lmcache.yaml", "alias bomb")
    assert took < 1.0


@pytest.mark.parametrize("flag", ["--model", "--model-dir"])
def test_an_over_long_path(flag: str, tmp_path: Path) -> None:
    result, took = invoke(["plan", f"{flag}={'a' * 300}", "--host-snapshot", str(HOST)], tmp_path)
    one_line_error(result, "longer than the system")
    assert took < 1.0


def test_a_duplicate_yaml_key_names_the_line(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=8192\noption.lmcache_config_file=lmcache.yaml\n")
    (mdir / "lmcache.yaml").write_text("chunk_size: 256\nmax_local_cpu_size: 4\nchunk_size: 512\n")
    result, _ = invoke(["serve", "--dry-run", "--model-dir", str(mdir), "--host-snapshot", str(HOST)], tmp_path)
    one_line_error(result, "line 3: key 'chunk_size' is already set on line 1")


@pytest.mark.parametrize(("args", "needle"), [
    (["plan", "--mdoel-dir", "x"], "No such option '--mdoel-dir'"),
    (["serve", "--dry-rn"], "Did you mean '--dry-run'?"),
    (["plna"], "Did you mean 'plan'?"),
])
def test_a_mistyped_flag_or_command_is_one_line_with_a_suggestion(args: list[str], needle: str,
                                                                  tmp_path: Path) -> None:
    result, _ = invoke(args, tmp_path)
    one_line_error(result, needle, "--help")


def test_a_property_that_overrides_an_option_variable_says_so(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=8192\n")
    result, _ = invoke(["serve", "--dry-run", "--model-dir", str(mdir), "--host-snapshot", str(HOST)], tmp_path,
                       OPTION_MAX_MODEL_LEN="4096")
    assert result.exit_code == 0, result.output
    said = [ln for ln in result.stdout.splitlines() if " overrides " in ln]
    assert said == [f"lmi-cache serve: note: {mdir / 'serving.properties'}:1: option.max_model_len overrides "
                    "environment variable OPTION_MAX_MODEL_LEN"]
