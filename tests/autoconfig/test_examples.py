"""Every serving.properties.d example resolves, plans and maps to a vLLM command on a fitting host."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autoconfig.probe.snapshot import DiskInfo, GpuInfo, HostSnapshot, MemoryInfo
from autoconfig.serve.launch import ServeLaunch, prepare_launch
from lmi_cache.errors import UserError

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "serving.properties.d"
FIXTURES = REPO / "tests" / "fixtures" / "hf_configs"
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 4096,
    "max_position_embeddings": 16384, "torch_dtype": "float32",
}


def host(num_gpus: int, ram_gib: int, gpu_gib: int = 48) -> HostSnapshot:
    gpus = [GpuInfo(i, "NVIDIA L40S", gpu_gib * GIB, (gpu_gib - 1) * GIB) for i in range(num_gpus)]
    disks = [DiskInfo("/", "/dev/nvme0n1p1", "xfs", 1000 * GIB, 800 * GIB, False, True, True)]
    return HostSnapshot(gpus=gpus, memory=MemoryInfo(ram_gib * GIB, ram_gib * GIB, None, None, 64 * GIB),
                        disks=disks, cpu_count=max(8, num_gpus * 12))


def stage(tmp_path: Path, example: str, model_config: str | None) -> Path:
    """The example's files in a model directory, as the model data would hold them."""
    mdir = tmp_path / "model"
    shutil.copytree(EXAMPLES / example, mdir)
    if model_config is not None:
        shutil.copy(FIXTURES / model_config / "config.json", mdir / "config.json")
    return mdir


def serve(mdir: Path, snapshot: HostSnapshot, tmp_path: Path) -> ServeLaunch:
    return prepare_launch(mdir, {}, host=snapshot, output_dir=tmp_path / "runtime", python="python")


def arg(launch: ServeLaunch, flag: str) -> str:
    assert launch.argv.count(flag) == 1, launch.argv
    return launch.argv[launch.argv.index(flag) + 1]


def example_dirs() -> list[str]:
    return sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())


def test_every_example_has_a_properties_file_and_a_readme_entry() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    assert len(example_dirs()) >= 4
    for name in example_dirs():
        assert (EXAMPLES / name / "serving.properties").is_file(), name
        assert f"`{name}/`" in readme, f"{name} is not listed in serving.properties.d/README.md"


def test_llama_70b_tp8_plans_on_an_8_gpu_instance(tmp_path: Path) -> None:
    launch = serve(stage(tmp_path, "llama-3.3-70b-tp8-autoconfig", "llama-3.3-70b-instruct"),
                   host(8, ram_gib=1536), tmp_path)
    assert launch.mode == "auto"
    assert arg(launch, "--tensor-parallel-size") == "8"
    assert arg(launch, "--max-model-len") == "32768"
    assert arg(launch, "--max-num-seqs") == "64"
    assert arg(launch, "--dtype") == "bfloat16"
    plan = json.loads((tmp_path / "runtime" / "plan.json").read_text())
    assert plan["parallel"]["tp"] == 8
    assert plan["tiers"]["cpu"]["bytes_per_rank"] > 10 * GIB  # 1.5 TiB of RAM over 8 ranks


def test_llama_70b_tp8_refuses_a_4_gpu_instance(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="needs 8 GPUs but this host has 4"):
        serve(stage(tmp_path, "llama-3.3-70b-tp8-autoconfig", "llama-3.3-70b-instruct"), host(4, 768), tmp_path)


def test_llama_8b_tp1_plans_on_one_gpu(tmp_path: Path) -> None:
    launch = serve(stage(tmp_path, "llama-3.1-8b-tp1-autoconfig", "llama-3.1-8b-instruct"), host(1, 128), tmp_path)
    assert launch.mode == "auto"
    assert "--tensor-parallel-size" not in launch.argv  # 1 is vLLM's default
    assert "--enable-prefix-caching" in launch.argv
    assert arg(launch, "--max-num-seqs") == "32"
    assert Path(launch.env_set["LMCACHE_CONFIG_FILE"]).is_file()


def test_manual_yaml_is_validated_and_used_as_is(tmp_path: Path) -> None:
    mdir = stage(tmp_path, "manual-lmcache-yaml", "llama-3.1-8b-instruct")
    launch = serve(mdir, host(1, 256), tmp_path)
    assert launch.mode == "file"
    assert launch.env_set["LMCACHE_CONFIG_FILE"] == str(mdir / "lmcache.yaml")
    assert json.loads(arg(launch, "--kv-transfer-config"))["kv_connector"] == "LmiCacheConnector"
    assert not (tmp_path / "runtime" / "lmcache.yaml").exists(), "file mode must not write its own YAML"


def test_manual_yaml_too_big_for_a_small_host_fails(tmp_path: Path) -> None:
    # The example asks 40 GiB of RAM per rank: a 32 GiB host cannot hold it.
    with pytest.raises(UserError, match="max_local_cpu_size"):
        serve(stage(tmp_path, "manual-lmcache-yaml", "llama-3.1-8b-instruct"), host(1, 32), tmp_path)


def test_cpu_tiny_demo_plans_on_a_cpu_only_host(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    mdir = stage(tmp_path, "cpu-tiny-demo", None)
    text = (mdir / "serving.properties").read_text()
    assert "option.model_id=/tmp/lmi-cache-tiny-7m" in text
    (mdir / "serving.properties").write_text(text.replace("/tmp/lmi-cache-tiny-7m", str(model)))
    launch = serve(mdir, host(0, 24), tmp_path)
    assert launch.mode == "auto"
    assert arg(launch, "--model") == str(model)
    assert arg(launch, "--dtype") == "float32"
    assert "--enforce-eager" in launch.argv and "--no-enable-prefix-caching" in launch.argv
    assert int(launch.env_set["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    plan = json.loads((tmp_path / "runtime" / "plan.json").read_text())
    assert plan["gpu"]["backend"] == "cpu"
    assert plan["tiers"]["cpu"]["bytes_per_rank"] == 1 * GIB
    assert plan["tiers"]["disk"]["enabled"] is False


def test_lmi_lmcache_recipe_runs_our_connector_with_its_yaml(tmp_path: Path) -> None:
    mdir = stage(tmp_path, "lmi-lmcache-recipe", "llama-3.1-8b-instruct")
    launch = serve(mdir, host(1, 256), tmp_path)
    assert launch.mode == "file"
    assert launch.env_set["LMCACHE_CONFIG_FILE"] == str(mdir / "lmcache.yaml")
    assert json.loads(arg(launch, "--kv-transfer-config"))["kv_connector"] == "LmiCacheConnector"
    assert arg(launch, "--dtype") == "bfloat16" and arg(launch, "--max-num-seqs") == "32"
    assert any("LMI's LMCache recipe" in line for line in launch.summary)
    assert any("option.max_new_tokens=256 ignored" in line for line in launch.summary)


def test_rag_blending_example_serves_the_blending_connector(tmp_path: Path) -> None:
    import yaml

    launch = serve(stage(tmp_path, "qwen2.5-7b-rag-blending", "qwen2.5-7b-instruct"), host(1, 128), tmp_path)
    assert json.loads(arg(launch, "--kv-transfer-config"))["kv_connector"] == "LmiCacheConnector"
    rendered = yaml.safe_load(Path(launch.env_set["LMCACHE_CONFIG_FILE"]).read_text())
    assert rendered["enable_blending"] is True and rendered["blend_recompute_ratios"] == [0.15]


def test_rag_blending_example_refuses_a_model_the_blender_does_not_cover(tmp_path: Path) -> None:
    mdir = stage(tmp_path, "qwen2.5-7b-rag-blending", "gemma-2-9b-it")
    props = mdir / "serving.properties"
    props.write_text(props.read_text().replace("max_model_len=32768", "max_model_len=8192"))  # Gemma 2's own
    with pytest.raises(UserError, match="gemma2"):
        serve(mdir, host(1, 128), tmp_path)
