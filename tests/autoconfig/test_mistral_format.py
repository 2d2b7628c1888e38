"""Mistral-format directories (params.json, no config.json): plan, configure, validate, serve --dry-run (no vLLM).

Regenerate the golden file after an intended change with
``LMI_CACHE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/autoconfig/test_mistral_format.py`` and review it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from plan_helpers import GIB, disk, memory
from test_cli import MODELS, _golden, _in_repo, _run  # noqa: F401 (_in_repo: autouse, runs from the repo root)

from autoconfig.model.kv import kv_layout_from_config
from autoconfig.model.mistral import adapt_params
from autoconfig.model.source import load_model_info
from autoconfig.probe.snapshot import GpuInfo, HostSnapshot
from autoconfig.serve.configure import configure
from autoconfig.serve.launch import prepare_launch
from lmi_cache.errors import UserError

LARGE3_BYTES = 61 * (512 + 64) * 2  # layers x (kv_lora_rank + qk_rope_head_dim) x 2 B (bf16)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
# Eight 141 GiB GPUs (an H200 node): Mistral Large 3's FP8 weights fit at TP 8.
H200X8 = HostSnapshot(gpus=[GpuInfo(i, "NVIDIA H200", 141 * GIB, 140 * GIB) for i in range(8)],
                      memory=memory(1800), disks=[disk("/nvme", free_gib=20000, total_gib=28000)], cpu_count=192)


def _params(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "params.json").read_text())


def _params_dir(tmp_path: Path, name: str, properties: str | None = None) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir()
    shutil.copy(FIXTURES / name / "params.json", mdir / "params.json")
    if properties is not None:
        (mdir / "serving.properties").write_text(properties)
    return mdir


def test_mistral_large_3_maps_to_deepseek_v3_mla() -> None:
    config = adapt_params(_params("mistral-large-3"), "params.json")
    assert config["architectures"] == ["MistralLarge3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert (config["num_hidden_layers"], config["n_routed_experts"], config["n_shared_experts"]) == (61, 128, 1)
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "static"}
    layout = kv_layout_from_config(config).layout
    assert layout.is_mla and layout.kv_bytes_per_token == LARGE3_BYTES


def test_a_params_only_directory_is_planned_from_params_json() -> None:
    info = load_model_info(f"{MODELS}/mistral-large-3")
    assert info.config_path.endswith("params.json") and info.kv.layout.kv_bytes_per_token == LARGE3_BYTES
    assert "MistralLarge3ForCausalLM" in info.kv.notes[0] and "config_format mistral" in info.kv.notes[0]
    assert info.kv.max_position_embeddings == 262144


def test_mistral_large_3_plan_golden_at_tp8() -> None:
    result = _run(["plan", "--model", f"{MODELS}/mistral-large-3", "--tp", "8", "--instance-type",
                   "ml.p5en.48xlarge", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["model"]["kv_bytes_per_token"] == plan["model"]["kv_bytes_per_token_per_rank"] == LARGE3_BYTES
    assert plan["explanation"][0] == f"kv_bytes_per_token = {LARGE3_BYTES:,}: 61 layers x latent 576 x 2 B (bfloat16, MLA)"
    assert plan["warnings"] == []  # the connector caches the latent: nothing to warn about
    args = plan["serve"]["vllm_args"]
    assert [args[args.index(flag) + 1] for flag in ("--config-format", "--tokenizer-mode", "--load-format")] == [
        "mistral"] * 3
    _golden("plan_mistral_large3_tp8_p5en.json", result.stdout)


def test_sliding_windows_listed_per_layer_become_layer_types() -> None:
    config = adapt_params(_params("ministral-window"), "params.json")
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == 32768
    assert config["layer_types"][:4] == ["full_attention"] + ["sliding_attention"] * 3
    info = kv_layout_from_config(config)
    assert (info.sliding_window, info.num_sliding_layers) == (32768, 27)
    one_window = adapt_params({**_params("ministral-window"), "sliding_window": 4096}, "params.json")
    assert one_window["layer_types"] == ["sliding_attention"] * 36


@pytest.mark.parametrize(("change", "needle"), [
    ({"sliding_window": [None, 4096, 8192]}, "several windows"),
    ({"sliding_window": "4096"}, "must be an integer or a list"),
    ({"sliding_window": [None, [4096]]}, "must hold integers and nulls"),
    ({"quantization": {"qformat_weight": "int3"}}, "unknown 'quantization'"),
])
def test_params_vllm_would_refuse_are_one_line_errors(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        adapt_params({**_params("ministral-window"), **change}, "params.json")


def test_a_params_json_that_is_not_a_model_names_the_missing_key(tmp_path: Path) -> None:
    (tmp_path / "params.json").write_text('{"learning_rate": 0.1}')
    result = _run(["plan", "--model", str(tmp_path), "--host-snapshot", "tests/fixtures/hosts/cpu_only_rotational.json"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == (f"lmi-cache: error: --model={tmp_path}: {tmp_path / 'params.json'}: no 'n_layers'; is this a Mistral "
                                     "model's params.json? point --model at the model's directory (config.json or "
                                     "Mistral's params.json)")


def test_other_mistral_shapes_follow_vllms_mapping() -> None:
    base = _params("ministral-window")
    assert adapt_params({**base, "moe": {"num_experts": 8, "num_experts_per_tok": 2}}, "p")["architectures"] == [
        "MixtralForCausalLM"]
    # MLA without MoE gets one shared expert, so vLLM maps it to Mistral Large 3 as well.
    mla = {**base, "kv_lora_rank": 256, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "llama_4_scaling": {}}
    assert adapt_params(mla, "p")["architectures"] == ["MistralLarge3ForCausalLM"]
    # A vision encoder moves the language model under text_config (Pixtral); the planner reads it there.
    pixtral = adapt_params({**base, "vision_encoder": {"hidden_size": 1024}}, "p")
    assert pixtral["model_type"] == "pixtral" and pixtral["text_config"]["num_hidden_layers"] == 36
    assert kv_layout_from_config(pixtral).layout.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    assert adapt_params({k: v for k, v in base.items() if k != "max_position_embeddings"}, "p")[
        "max_position_embeddings"] == 128_000


def test_serve_dry_run_passes_the_mistral_format_flags(tmp_path: Path) -> None:
    mdir = _params_dir(tmp_path, "mistral-large-3", "option.lmcache_auto_config=true\noption.tensor_parallel_degree=8\n"
                                                    "option.tokenizer_mode=auto\n")
    launch = prepare_launch(mdir, {}, host=H200X8, output_dir=tmp_path / "run", python="python3", dry_run=True)
    argv = launch.argv
    assert argv[argv.index("--model") + 1] == str(mdir)
    assert argv[argv.index("--config-format") + 1] == "mistral" and argv[argv.index("--load-format") + 1] == "mistral"
    # The user's own choice wins, once.
    assert argv.count("--tokenizer-mode") == 1 and argv[argv.index("--tokenizer-mode") + 1] == "auto"
    assert any("params.json and no config.json" in line for line in launch.summary)
    assert launch.plan is not None and launch.plan.kv_bytes_per_token == LARGE3_BYTES
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_config_json_directories_get_no_mistral_flags(tmp_path: Path) -> None:
    mdir = tmp_path / "model"
    mdir.mkdir()
    shutil.copy(FIXTURES / "mistral-7b-v0.1" / "config.json", mdir / "config.json")
    shutil.copy(FIXTURES / "ministral-window" / "params.json", mdir / "params.json")  # both: vLLM's auto decides
    launch = prepare_launch(mdir, {}, host=H200X8, output_dir=tmp_path / "run", python="python3", dry_run=True)
    assert "--config-format" not in launch.argv and "--load-format" not in launch.argv


def test_configure_writes_the_plan_of_a_params_only_directory(tmp_path: Path) -> None:
    mdir = _params_dir(tmp_path, "mistral-large-3", "option.lmcache_auto_config=true\noption.tensor_parallel_degree=8\n")
    result = configure(mdir, tmp_path / "out", {}, host=H200X8)
    assert result.mode == "auto"
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["model"]["kv_bytes_per_token"] == LARGE3_BYTES


def test_validate_reads_a_params_only_model_dir(tmp_path: Path) -> None:
    mdir = _params_dir(tmp_path, "ministral-window")
    good = tmp_path / "lmcache.yaml"
    good.write_text("chunk_size: 256\nmax_local_cpu_size: 20\n")
    result = _run(["validate", str(good), "--model-dir", str(mdir), "--instance-type", "ml.p5en.48xlarge"])
    assert result.exit_code == 0, result.output
    assert "0 error(s)" in result.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _run(["validate", str(good), "--model-dir", str(empty), "--instance-type", "ml.p5en.48xlarge"])
    assert refused.exit_code != 0 and "no model" in refused.output
