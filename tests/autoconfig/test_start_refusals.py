"""Starts vLLM would refuse are refused first: one line, exit 2, before vLLM is imported, by serve and plan alike."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import one_line_error
from click.testing import CliRunner, Result

from autoconfig.cli import main
from autoconfig.plan.start_checks import derived_max_model_len

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "fixtures" / "hf_configs"


def model_dir(tmp_path: Path, model: str, properties: str) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir(exist_ok=True)
    shutil.copy(MODELS / model / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text(properties)
    return mdir


def run(command: list[str], mdir: Path, tmp_path: Path, **env: str) -> Result:
    base = {"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "runtime"), "VLLM_ALLOW_LONG_MAX_MODEL_LEN": None}
    return CliRunner().invoke(main, [*command, "--model-dir", str(mdir)], env={**base, **env})  # type: ignore[dict-item]


COMMANDS = [["serve", "--dry-run", "--instance-type", "ml.g6e.xlarge"], ["plan", "--instance-type", "ml.g6e.xlarge"]]


@pytest.mark.parametrize("command", COMMANDS, ids=["serve", "plan"])
@pytest.mark.parametrize("cache", ["option.lmcache_auto_config=true\n", ""], ids=["auto", "off"])
def test_max_model_len_above_the_models_is_refused(command: list[str], cache: str, tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "llama-3.1-8b-instruct", "option.max_model_len=1000000\n" + cache)
    one_line_error(run(command, mdir, tmp_path), "option.max_model_len=1000000", "131,072", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")


def test_allow_long_max_model_len_moves_on_to_the_kv_check(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "llama-3.1-8b-instruct", "option.max_model_len=1000000\n")
    line = one_line_error(run(COMMANDS[0], mdir, tmp_path, VLLM_ALLOW_LONG_MAX_MODEL_LEN="1"), "GPU KV cache holds")
    assert "131,072" not in line


@pytest.mark.parametrize("command", COMMANDS, ids=["serve", "plan"])
def test_kv_cache_smaller_than_one_sequence_names_the_length_that_fits(command: list[str], tmp_path: Path) -> None:
    # Llama-3.1-8B's own 131,072 tokens need 16 GiB of KV; one 24 GiB A10G keeps a few GiB after the weights.
    mdir = model_dir(tmp_path, "llama-3.1-8b-instruct", "option.lmcache_auto_config=true\n")
    command = [c if c != "ml.g6e.xlarge" else "ml.g5.2xlarge" for c in command]
    line = one_line_error(run(command, mdir, tmp_path), "max_model_len=131072", "less than one sequence")
    fits = int(re.search(r"set max_model_len to (\d+) or less", line).group(1))
    assert 10_000 < fits < 131_072
    (mdir / "serving.properties").write_text(f"option.lmcache_auto_config=true\noption.max_model_len={fits}\n")
    assert run(command, mdir, tmp_path).exit_code == 0
    (mdir / "serving.properties").write_text(f"option.lmcache_auto_config=true\noption.max_model_len={fits + 16}\n")
    one_line_error(run(command, mdir, tmp_path), "less than one sequence")


@pytest.mark.parametrize("command", COMMANDS, ids=["serve", "plan"])
def test_tp_that_does_not_split_the_heads_is_refused_in_every_mode(command: list[str], tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "qwen2.5-7b-instruct", "option.tensor_parallel_degree=3\noption.max_model_len=8192\n")
    cmd = [c if c != "ml.g6e.xlarge" else "ml.g6e.12xlarge" for c in command]
    one_line_error(run(cmd, mdir, tmp_path), "option.tensor_parallel_degree=3", "28 attention heads", "use one of")


def test_pp_above_the_layers_is_refused(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "qwen2.5-0.5b-instruct", "option.pipeline_parallel_degree=32\noption.tensor_parallel_degree=1\n")
    host = tmp_path / "host.json"
    snap = json.loads(CliRunner().invoke(main, ["probe", "--instance-type", "ml.p4d.24xlarge", "--json"]).stdout)
    snap["gpus"] = [dict(snap["gpus"][0], index=i) for i in range(32)]
    host.write_text(json.dumps(snap))
    one_line_error(run(["serve", "--dry-run", "--host-snapshot", str(host)], mdir, tmp_path), "pipeline_parallel_degree=32",
            "24 layers")


def test_refusal_comes_before_vllm_is_imported(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "llama-3.1-8b-instruct", "option.max_model_len=1000000\n")
    code = ("import sys\nfrom autoconfig.cli import main\ntry:\n    main(['serve', '--model-dir', sys.argv[1], "
            "'--instance-type', 'ml.g6e.xlarge'])\nexcept SystemExit as e:\n"
            "    print('vllm' in sys.modules, e.code)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(mdir)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                               "LMI_CACHE_RUNTIME_DIR": str(tmp_path / "rt")})
    assert proc.stdout.split() == ["False", "2"], proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "131,072" in proc.stderr


def test_derived_length_follows_vllms_rope_rules() -> None:
    base = {"max_position_embeddings": 4096}
    assert derived_max_model_len(base) == (4096, "max_position_embeddings")
    assert derived_max_model_len({**base, "rope_scaling": {"type": "linear", "factor": 4.0}})[0] == 16384
    assert derived_max_model_len({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})[0] == 4096
    assert derived_max_model_len({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})[0] == 4096
    assert derived_max_model_len({**base, "n_positions": 2048}) == (2048, "n_positions")
    assert derived_max_model_len({"hidden_size": 8}) is None
