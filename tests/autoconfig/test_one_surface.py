"""plan, serve --dry-run, validate, configure and probe read the same inputs and agree.

``plan --model-dir D`` and ``serve --dry-run --model-dir D`` must print the same
TP, tiers and vLLM arguments for every example in serving.properties.d/ on a
set of instance types (or refuse with the same line); every command takes the
same host sources and LMI's value spellings.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from autoconfig.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "serving.properties.d"
MODELS = REPO / "tests" / "fixtures" / "hf_configs"
# The model each example is written for (cpu-tiny-demo: a tiny Llama made in the test).
EXAMPLE_MODELS = {
    "llama-3.1-8b-tp1-autoconfig": "llama-3.1-8b-instruct",
    "llama-3.3-70b-tp8-autoconfig": "llama-3.3-70b-instruct",
    "lmi-lmcache-recipe": "llama-3.1-8b-instruct",
    "manual-lmcache-yaml": "llama-3.1-8b-instruct",
    "qwen2.5-7b-rag-blending": "qwen2.5-7b-instruct",
    "cpu-tiny-demo": "qwen2.5-0.5b-instruct",
}
INSTANCE_TYPES = ["ml.g5.2xlarge", "ml.g6e.xlarge", "ml.g6e.12xlarge", "ml.p4d.24xlarge"]
GIB = 1 << 30


def stage(tmp_path: Path, example: str) -> Path:
    """The example's files with the model's config.json, as the model data would hold them."""
    mdir = tmp_path / "model"
    shutil.copytree(EXAMPLES / example, mdir)
    shutil.copy(MODELS / EXAMPLE_MODELS[example] / "config.json", mdir / "config.json")
    props = mdir / "serving.properties"
    props.write_text(re.sub(r"(?m)^option\.model_id=.*$", "", props.read_text()))
    return mdir


def cli(args: list[str], tmp_path: Path, **env: str) -> Result:
    runtime = tmp_path / "runtime"
    return CliRunner().invoke(main, args, env={"LMI_CACHE_RUNTIME_DIR": str(runtime), **env})


def serve_facts(output: str) -> dict[str, object]:
    """TP, tiers and vLLM arguments as serve --dry-run prints them."""
    lines = output.splitlines()
    parallel = next(ln for ln in lines if ": parallel: " in ln)
    cache = next(ln for ln in lines if ": cache: " in ln)
    exec_line = next(ln for ln in lines if ln.startswith("exec: "))
    import shlex

    argv = shlex.split(exec_line[len("exec: "):])
    return {"tp": int(re.search(r"tp=(\d+)", parallel).group(1)), "cache": cache.split(": cache: ", 1)[1],
            "vllm_args": argv[argv.index("vllm.entrypoints.openai.api_server") + 1:]}


def tier_text(plan: dict) -> str:
    cpu, disk = plan["tiers"]["cpu"], plan["tiers"]["disk"]
    parts = [f"CPU tier {cpu['bytes_per_rank'] / GIB:.2f} GiB/rank" if cpu["enabled"] else "CPU tier off",
             f"disk tier {disk['bytes_per_rank'] / GIB:.2f} GiB/rank at {disk['path']}" if disk["enabled"]
             else "disk tier off", f"chunk {plan['chunk_size']} tokens"]
    return f"auto-configured ({'; '.join(parts)})"


@pytest.mark.parametrize("instance_type", INSTANCE_TYPES)
@pytest.mark.parametrize("example", sorted(EXAMPLE_MODELS))
def test_plan_and_serve_dry_run_agree(example: str, instance_type: str, tmp_path: Path) -> None:
    mdir = stage(tmp_path, example)
    common = ["--model-dir", str(mdir), "--instance-type", instance_type]
    planned = cli(["plan", *common, "--json"], tmp_path)
    served = cli(["serve", "--dry-run", *common], tmp_path)
    assert "Traceback" not in planned.output + served.output
    if served.exit_code != 0:  # a start serve refuses, plan refuses with the same line
        assert planned.exit_code == served.exit_code == 2, (planned.output, served.output)
        assert planned.stderr == served.stderr and served.stderr.startswith("lmi-cache: error: ")
        return
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.stdout)
    facts = serve_facts(served.stdout)
    assert plan["parallel"]["tp"] == facts["tp"]
    assert plan["serve"]["vllm_args"] == facts["vllm_args"]
    if plan["serve"]["cache_mode"] == "auto":
        assert facts["cache"] == tier_text(plan)
    elif plan["serve"]["cache_mode"] == "file":  # the user's YAML: both show the tiers it runs
        assert facts["cache"].startswith("LMCache config from")
        assert facts["cache"].endswith(tier_text(plan).split(" ", 1)[1]), (facts["cache"], tier_text(plan))
    else:
        assert facts["cache"].startswith("off")


def test_examples_cover_refusals_and_starts(tmp_path: Path) -> None:
    """The matrix above is not all refusals: the 70B example starts on 8 GPUs with TP 8 in both commands."""
    mdir = stage(tmp_path, "llama-3.3-70b-tp8-autoconfig")
    plan = json.loads(cli(["plan", "--model-dir", str(mdir), "--instance-type", "ml.p4d.24xlarge", "--json"],
                          tmp_path).stdout)
    assert plan["parallel"]["tp"] == 8 and plan["serve"]["cache_mode"] == "auto"
    small = cli(["plan", "--model-dir", str(mdir), "--instance-type", "ml.g6e.xlarge"], tmp_path)
    assert small.exit_code == 2 and "needs 8 GPUs but this host has 1" in small.stderr


def test_plan_takes_lmis_default_tp_max(tmp_path: Path) -> None:
    """No TP anywhere: LMI's 'max', every GPU of the instance, as serve does (not 1)."""
    mdir = tmp_path / "m"
    mdir.mkdir()
    shutil.copy(MODELS / "llama-3.1-8b-instruct" / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text("option.lmcache_auto_config=true\n")
    plan = json.loads(cli(["plan", "--model-dir", str(mdir), "--instance-type", "ml.p4d.24xlarge", "--json"],
                          tmp_path).stdout)
    assert plan["parallel"]["tp"] == 8
    alone = json.loads(cli(["plan", "--model", str(MODELS / "llama-3.1-8b-instruct"), "--instance-type",
                            "ml.p4d.24xlarge", "--json"], tmp_path).stdout)
    assert alone["parallel"]["tp"] == 8
    assert alone["tiers"]["cpu"]["bytes_per_rank"] == plan["tiers"]["cpu"]["bytes_per_rank"]


def test_plan_flags_override_properties_and_say_so(tmp_path: Path) -> None:
    mdir = stage(tmp_path, "llama-3.1-8b-tp1-autoconfig")
    result = cli(["plan", "--model-dir", str(mdir), "--instance-type", "ml.g6e.12xlarge", "--tp", "2"], tmp_path,
                 OPTION_MAX_MODEL_LEN="8192")
    assert result.exit_code == 0, result.output
    notes = [ln for ln in result.stdout.splitlines() if "overrides" in ln]
    assert any("--tp overrides" in ln and "option.tensor_parallel_degree" in ln for ln in notes), notes
    assert any("option.max_model_len overrides environment variable OPTION_MAX_MODEL_LEN" in ln for ln in notes)
    assert "--tensor-parallel-size 2" in result.stdout


@pytest.mark.parametrize("spelling", ["fp16", "bf16", "float16", "bfloat16"])
def test_plan_accepts_lmis_dtype_spellings(spelling: str, tmp_path: Path) -> None:
    result = cli(["plan", "--model", str(MODELS / "llama-3.1-8b-instruct"), "--instance-type", "ml.g6e.xlarge",
                  "--max-model-len", "8192", "--dtype", spelling, "--json"], tmp_path)
    assert result.exit_code == 0, result.output
    vllm = "float16" if "16" in spelling and "b" not in spelling else "bfloat16"
    args = json.loads(result.stdout)["serve"]["vllm_args"]
    assert args[args.index("--dtype") + 1] == vllm


def test_probe_writes_an_instance_types_snapshot_that_plan_reads(tmp_path: Path) -> None:
    probed = cli(["probe", "--instance-type", "ml.g6e.12xlarge", "--json"], tmp_path)
    assert probed.exit_code == 0, probed.output
    snap = tmp_path / "g6e.json"
    snap.write_text(probed.stdout)
    assert len(json.loads(probed.stdout)["gpus"]) == 4
    model = ["--model", str(MODELS / "llama-3.1-8b-instruct"), "--max-model-len", "8192", "--json"]
    from_file = json.loads(cli(["plan", *model, "--host-snapshot", str(snap)], tmp_path).stdout)
    assert from_file["parallel"]["tp"] == 4
    text = cli(["probe", "--host-snapshot", str(snap)], tmp_path)
    assert text.exit_code == 0 and text.stdout.startswith("GPUs: 4")


def test_every_command_takes_the_same_host_sources() -> None:
    for name in ("plan", "serve", "validate", "configure", "probe"):
        params = {p.name for p in main.commands[name].params}
        assert {"host_file", "instance_type"} <= params, name
    for name in ("plan", "serve", "validate", "configure"):
        assert "model_dir" in {p.name for p in main.commands[name].params}, name


def test_host_and_instance_type_together_is_one_line(tmp_path: Path) -> None:
    result = cli(["serve", "--dry-run", "--host-snapshot", "x.json", "--instance-type", "ml.g6e.xlarge"], tmp_path)
    assert result.exit_code == 2 and "use --host-snapshot or --instance-type, not both" in result.stderr


def test_configure_for_an_instance_type(tmp_path: Path) -> None:
    mdir = stage(tmp_path, "llama-3.1-8b-tp1-autoconfig")
    out = tmp_path / "out"
    result = cli(["configure", "--model-dir", str(mdir), "--output-dir", str(out), "--instance-type",
                  "ml.g6e.xlarge"], tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "plan.json").read_text())["gpu"]["num_gpus"] == 1


def test_validate_reads_the_yaml_the_model_dir_names_and_lmcache_env(tmp_path: Path) -> None:
    mdir = stage(tmp_path, "manual-lmcache-yaml")
    common = ["validate", "--model-dir", str(mdir), "--instance-type", "ml.g6e.12xlarge"]
    ok = cli(common, tmp_path)
    assert ok.exit_code == 0, ok.output
    assert f"{mdir / 'lmcache.yaml'}: 0 error(s)" in ok.stdout
    bad = cli(common, tmp_path, LMCACHE_CHUNK_SIZE="abc")
    assert bad.exit_code == 1 and "LMCACHE_CHUNK_SIZE" in bad.stdout, bad.output
    override = cli(common, tmp_path, LMCACHE_CHUNK_SIZE="512")
    assert override.exit_code == 0 and "LMCACHE_CHUNK_SIZE override the file" in override.stdout


def test_validate_refuses_a_max_model_len_vllm_would_refuse(tmp_path: Path) -> None:
    mdir = stage(tmp_path, "manual-lmcache-yaml")
    common = ["validate", "--model-dir", str(mdir), "--instance-type", "ml.g6e.12xlarge", "--max-model-len", "200000"]
    result = cli(common, tmp_path)
    assert result.exit_code == 1 and "--max-model-len=200000: above the model's 131,072" in result.stdout, result.output
    assert cli(common, tmp_path, VLLM_ALLOW_LONG_MAX_MODEL_LEN="1").stdout.count("above the model's") == 0


def test_plan_model_alone_follows_a_yaml_named_in_the_environment(tmp_path: Path) -> None:
    """plan --model plans auto-configuration unless the environment names a YAML: then it says serve uses that."""
    yaml_path = tmp_path / "lmcache.yaml"
    yaml_path.write_text("chunk_size: 256\nmax_local_cpu_size: 4\n")
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b-instruct"), "--instance-type", "ml.g6e.xlarge",
            "--max-model-len", "8192", "--json"]
    plan = json.loads(cli(args, tmp_path, LMCACHE_CONFIG_FILE=str(yaml_path)).stdout)
    assert plan["serve"]["cache_mode"] == "file" and str(yaml_path) in plan["serve"]["cache"]
    assert json.loads(cli(args, tmp_path).stdout)["serve"]["cache_mode"] == "auto"
