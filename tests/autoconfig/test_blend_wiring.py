"""Blending turned on the LMI way: options, OPTION_* / LMCACHE_* env, the user's YAML, refused models, --engine lmcache.

Each path is checked where users see it: the vLLM arguments ``serve`` would exec
(``prepare_launch``, dry run), the YAML ``configure`` writes, ``plan``'s explanation
and the one-line errors of the CLI.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from autoconfig.lmi.blend_options import BLEND_OPTIONS, BlendOptionError, resolve_blend
from autoconfig.cli import main
from autoconfig.serve.configure import configure
from autoconfig.probe.snapshot import GpuInfo, HostSnapshot, MemoryInfo
from autoconfig.lmi.to_vllm import LMCACHE_OPTIONS
from autoconfig.model.source import load_model_info
from autoconfig.plan.types import PlanError
from autoconfig.plan.planner import plan_tiers
from autoconfig.lmi.properties import RawOption
from autoconfig.serve.launch import ServeLaunch, prepare_launch
from autoconfig.plan.settings import ServingSettings
from lmi_cache.blend.settings import BlendSettings
from lmi_cache.errors import UserError

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "fixtures" / "hf_configs"
# Blending is switched by enable_blending in the rendered YAML; vLLM loads the one connector.
BLEND = {"kv_connector": "LmiCacheConnector", "kv_connector_module_path": "lmi_cache.vllm_connector",
         "kv_role": "kv_both"}


def _host() -> HostSnapshot:
    return HostSnapshot(gpus=[GpuInfo(0, "NVIDIA L40S", 48 * GIB, 47 * GIB)],
                        memory=MemoryInfo(256 * GIB, 256 * GIB, None, None, 64 * GIB), disks=[], cpu_count=48)


def _model_dir(tmp_path: Path, properties: str, model: str = "qwen2.5-7b-instruct") -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir(exist_ok=True)
    shutil.copy(MODELS / model / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text(properties)
    return mdir


def _launch(tmp_path: Path, properties: str, env: dict[str, str] | None = None, model: str = "qwen2.5-7b-instruct",
            dry_run: bool = True) -> ServeLaunch:
    return prepare_launch(_model_dir(tmp_path, properties, model), env or {}, host=_host(),
                          output_dir=tmp_path / "runtime", python="python", dry_run=dry_run)


def _connector(argv: list[str]) -> dict[str, Any]:
    assert argv.count("--kv-transfer-config") == 1
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def _written_yaml(tmp_path: Path) -> dict[str, Any]:
    return yaml.safe_load((tmp_path / "runtime" / "lmcache.yaml").read_text())


# -- the three ways in -------------------------------------------------------------------------


def test_options_select_the_blending_connector_and_the_yaml_carries_the_keys(tmp_path: Path) -> None:
    launch = _launch(tmp_path, "option.lmcache_auto_config=true\noption.lmcache_enable_blending=true\n"
                               "option.lmcache_blend_recompute_ratios=0.3\noption.lmcache_blend_min_tokens=128\n",
                     dry_run=False)
    assert _connector(launch.argv) == BLEND
    assert not any(a.startswith("--lmcache") for a in launch.argv)  # consumed, never passed to vLLM
    data = _written_yaml(tmp_path)
    assert data["enable_blending"] is True and data["blend_recompute_ratios"] == [0.3]
    assert data["blend_min_tokens"] == 128 and data["blend_check_layers"] == [1]
    assert data["blend_special_str"] == " # # "
    assert BlendSettings.from_mapping(data).recompute_ratios == (0.3,)  # what the connector reads back
    line = next(s for s in launch.summary if "blending on" in s)
    assert "option.lmcache_enable_blending=true" in line and "LmiCacheConnector" in line
    plan = json.loads((tmp_path / "runtime" / "plan.json").read_text())
    assert plan["blending"]["connector"] == "LmiCacheConnector"


def test_option_env_variables_are_the_same_setting(tmp_path: Path) -> None:
    launch = _launch(tmp_path, "option.lmcache_auto_config=true\n",
                     {"OPTION_LMCACHE_ENABLE_BLENDING": "TRUE", "OPTION_LMCACHE_BLEND_CHECK_LAYERS": "[1, 3]",
                      "OPTION_LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.3,0.1"}, dry_run=False)
    assert _connector(launch.argv) == BLEND
    data = _written_yaml(tmp_path)
    assert data["blend_check_layers"] == [1, 3] and data["blend_recompute_ratios"] == [0.3, 0.1]


def test_lmcache_env_turns_it_on_over_auto_configuration(tmp_path: Path) -> None:
    launch = _launch(tmp_path, "option.lmcache_auto_config=true\n", {"LMCACHE_ENABLE_BLENDING": "true"},
                     dry_run=False)
    assert _connector(launch.argv) == BLEND
    assert _written_yaml(tmp_path)["enable_blending"] is True
    assert any("environment variable LMCACHE_ENABLE_BLENDING=true" in s for s in launch.summary)
    # lmi_cache.config.cache_config's hint for the exact-prefix connector is not shown when the blending one is loaded.
    assert not any("blending needs the blending connector" in s for s in launch.summary)
    off = _launch(tmp_path, "option.lmcache_auto_config=true\n", {"LMCACHE_ENABLE_BLENDING": "false"})
    assert _connector(off.argv)["kv_connector"] == "LmiCacheConnector"


def test_the_users_own_yaml_with_enable_blending(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n")
    (mdir / "lmcache.yaml").write_text("chunk_size: 256\nmax_local_cpu_size: 5\nenable_blending: true\n"
                                       "blend_recompute_ratios: [0.2]\n")
    result = configure(mdir, tmp_path / "runtime", {}, host=_host())
    assert result.mode == "file" and _connector(result.vllm_args) == BLEND
    assert result.properties.settings.blend.recompute_ratios == (0.2,)
    assert any("blending on" in m and "lmcache.yaml: enable_blending: True" in m for m in result.messages)
    launch = prepare_launch(mdir, {}, host=_host(), output_dir=tmp_path / "rt2", python="python", dry_run=True)
    assert _connector(launch.argv) == BLEND
    # LMCache's rule: the environment beats the file.
    off = configure(mdir, tmp_path / "runtime", {"LMCACHE_ENABLE_BLENDING": "false"}, host=_host())
    assert _connector(off.vllm_args)["kv_connector"] == "LmiCacheConnector"


def test_lmi_options_are_refused_next_to_the_users_own_yaml(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\noption.lmcache_enable_blending=true\n")
    (mdir / "lmcache.yaml").write_text("chunk_size: 256\n")
    with pytest.raises(UserError, match=r"option.lmcache_enable_blending: .*put enable_blending in lmcache.yaml"):
        configure(mdir, tmp_path / "runtime", {}, host=_host())


# -- refusals: one line, nothing written ---------------------------------------------------------


def _cli(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, args, env=env, catch_exceptions=False)


@pytest.mark.parametrize(("model", "needle"), [("gemma-2-9b-it", "model_type 'gemma2'"),
                                               ("mistral-7b-v0.1", "sliding-window")])
def test_a_model_the_blender_does_not_cover_fails_configure_with_one_line(tmp_path: Path, model: str,
                                                                         needle: str) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\noption.lmcache_enable_blending=true\n", model)
    out = tmp_path / "runtime"
    # configure probes this machine; the refusal comes from the model, whatever the host.
    result = _cli(["configure", "--model-dir", str(mdir), "--output-dir", str(out)])
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]
    assert line.startswith("lmi-cache: error: ") and "option.lmcache_enable_blending=true" in line and needle in line
    assert not out.exists() or not any(out.iterdir()), "nothing is written"


def test_serve_dry_run_refuses_an_uncovered_model(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        _launch(tmp_path, "option.lmcache_auto_config=true\n", {"OPTION_LMCACHE_ENABLE_BLENDING": "true"},
                model="gemma-2-9b-it")
    text = str(err.value)
    assert "\n" not in text and "OPTION_LMCACHE_ENABLE_BLENDING=true" in text and "model_type 'gemma2'" in text
    assert not (tmp_path / "runtime").exists()


def test_the_users_yaml_on_an_uncovered_model_is_refused(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n", "gemma-2-9b-it")
    (mdir / "lmcache.yaml").write_text("chunk_size: 256\nenable_blending: true\n")
    with pytest.raises(PlanError, match=r"lmcache.yaml: enable_blending: True: .*model_type 'gemma2'"):
        configure(mdir, tmp_path / "runtime", {}, host=_host())
    assert not (tmp_path / "runtime").exists()


def test_bad_values_and_check_layers_past_the_model(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"^environment variable OPTION_LMCACHE_BLEND_RECOMPUTE_RATIOS: '1.5' is outside"):
        _launch(tmp_path, "option.lmcache_auto_config=true\n",
                {"OPTION_LMCACHE_ENABLE_BLENDING": "true", "OPTION_LMCACHE_BLEND_RECOMPUTE_RATIOS": "1.5"})
    with pytest.raises(UserError, match=r"blend_check_layers: layer 40 does not exist .*28 layers"):
        _launch(tmp_path, "option.lmcache_auto_config=true\noption.lmcache_enable_blending=true\n"
                          "option.lmcache_blend_check_layers=40\n")
    with pytest.raises(UserError, match=r"serving.properties:\d+: option.lmcache_enable_blending: .*'maybe'"):
        _launch(tmp_path, "option.lmcache_auto_config=true\noption.lmcache_enable_blending=maybe\n")
    mdir = _model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n")
    (mdir / "lmcache.yaml").write_text("chunk_size: 256\nenable_blending: true\nblend_min_tokens: -1\n")
    with pytest.raises(UserError, match=r"lmcache.yaml: .*blend_min_tokens"):
        configure(mdir, tmp_path / "runtime", {}, host=_host())


# -- upstream LMCache ------------------------------------------------------------------------------


def test_engine_lmcache_refuses_the_lmi_option_and_passes_lmcache_settings_through() -> None:
    opt = RawOption("lmcache_enable_blending", "true", "option.lmcache_enable_blending", "serving.properties")
    with pytest.raises(BlendOptionError, match=r"option.lmcache_enable_blending=true with option.lmcache_engine=lmcache"):
        resolve_blend({opt.name: opt}, {}, None, "", "lmcache")
    # LMCache's own setting (its env, or its YAML) is upstream LMCache's to read: passed through, said in the plan.
    blend, where = resolve_blend({}, {"LMCACHE_ENABLE_BLENDING": "True"}, None, "", "lmcache")
    assert blend.enabled and where == "environment variable LMCACHE_ENABLE_BLENDING=True"
    info = load_model_info(str(MODELS / "qwen2.5-7b-instruct"))
    plan = plan_tiers(_host(), info, ServingSettings(engine="lmcache", blend=blend, blend_where=where))
    assert json.loads(plan.vllm_args[1])["kv_connector"] == "LMCacheConnectorV1"
    assert "enable_blending" not in plan.lmcache_config and plan.blend is None
    assert any("read by upstream LMCache itself" in w for w in plan.warnings)


def test_plan_explains_blending_and_refuses_engine_lmcache_with_it() -> None:
    host = str(REPO / "tests" / "fixtures" / "hosts" / "a100x8_nvme_cgroup.json")
    model = str(MODELS / "llama-3.1-8b-instruct")
    result = _cli(["plan", "--model", model, "--host-snapshot", host, "--enable-blending", "--blend-recompute-ratios", "0.3"])
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if "blending = on" in ln]
    assert "--enable-blending" in line and "30%" in line and "model_type 'llama' is covered" in line
    assert "LmiCacheConnector blends" in line
    plain = _cli(["plan", "--model", model, "--host-snapshot", host])
    assert "blending" not in plain.output and "LmiCacheConnector" in plain.output
    refused = _cli(["plan", "--model", model, "--host-snapshot", host, "--enable-blending", "--engine", "lmcache"])
    assert refused.exit_code == 2 and "--engine lmcache" in refused.output
    gemma = _cli(["plan", "--model", str(MODELS / "gemma-2-9b-it"), "--host-snapshot", host, "--enable-blending"])
    assert gemma.exit_code == 2 and "--enable-blending=true: " in gemma.output and "model_type 'gemma2'" in gemma.output


def test_every_blend_option_is_kept_from_vllm() -> None:
    assert set(BLEND_OPTIONS) <= LMCACHE_OPTIONS
    assert set(BLEND_OPTIONS.values()) == set(BlendSettings().to_lmcache_dict())


def test_prepare_launch_with_blending_imports_neither_vllm_nor_torch(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=true\noption.lmcache_enable_blending=true\n")
    host = tmp_path / "host.json"
    host.write_text(json.dumps(_host().to_dict()))
    code = textwrap.dedent(f"""
        import json, sys
        from autoconfig.serve.launch import load_host_file, prepare_launch
        launch = prepare_launch({str(mdir)!r}, {{}}, host=load_host_file({str(host)!r}),
                                output_dir={str(tmp_path / 'rt')!r}, dry_run=True)
        assert json.loads(launch.argv[launch.argv.index("--kv-transfer-config") + 1])["kv_connector"] == "LmiCacheConnector"
        print(sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_validate_names_blending_on_an_uncovered_model(tmp_path: Path) -> None:
    host = str(REPO / "tests" / "fixtures" / "hosts" / "a100x8_nvme_cgroup.json")
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nmax_local_cpu_size: 5\nenable_blending: true\n")
    bad = _cli(["validate", str(config), "--model", str(MODELS / "gemma-2-9b-it"), "--host-snapshot", host])
    assert bad.exit_code == 1
    assert any(ln.startswith("ERROR   enable_blending:") and "model_type 'gemma2'" in ln for ln in bad.output.splitlines())
    good = _cli(["validate", str(config), "--model", str(MODELS / "qwen2.5-7b-instruct"), "--host-snapshot", host])
    assert good.exit_code == 0, good.output


def test_the_blending_option_without_the_cache_is_an_error_not_a_silent_no(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"option.lmcache_enable_blending: configures the KV cache, which nothing "
                                        r"turns on; add option.lmcache_auto_config=true"):
        _launch(tmp_path, "option.lmcache_enable_blending=true\n")
    off = _launch(tmp_path, "option.lmcache_enable_blending=false\n")  # saying no is fine
    assert "--kv-transfer-config" not in off.argv


def test_on_the_cpu_backend_the_plan_reserves_the_blend_heap_per_worker() -> None:
    from autoconfig.probe.snapshot import load_snapshot_file
    from autoconfig.plan.settings import ServingSettings
    from lmi_cache.blend.host_heap import blend_heap_bytes

    import dataclasses

    host = load_snapshot_file(str(REPO / "tests" / "fixtures" / "hosts" / "cpu_only_rotational.json"))
    # The same CPU-only host with room for an 8B model's weights beside a CPU tier.
    host = dataclasses.replace(host, memory=dataclasses.replace(host.memory, total_bytes=256 << 30,
                                                                available_bytes=250 << 30))
    model = load_model_info(str(MODELS / "llama-3.1-8b-instruct"))
    off = plan_tiers(host, model, ServingSettings(max_model_len=8192))
    on = plan_tiers(host, model, ServingSettings(max_model_len=8192, blend=BlendSettings(enabled=True)))
    heap = blend_heap_bytes(32, 8, 128, 8192)  # 16 x 8192 tokens x 32 layers x 8 KV heads x 128 x 4 B: the cap
    assert heap == 960 << 20
    assert off.gpu.backend == on.gpu.backend == "cpu"
    # The CPU tier gives the heap back (to the 0.01 GiB the plan rounds to), and the plan says why.
    assert off.cpu.fit_bytes_per_rank - on.cpu.fit_bytes_per_rank == heap
    assert any("blend heap" in line for line in on.explanation)
    assert not any("blend heap" in line for line in off.explanation)
