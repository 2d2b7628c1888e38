"""What LMI users write works unchanged: the LMCache recipe, simplified env vars, defaults, typos.

Each case is an ``lmi-cache serve`` start (``prepare_launch``, no exec) on a
host snapshot; LMI's rules are cited in autoconfig/lmi/names.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoconfig.lmi.properties import resolve_properties
from lmi_cache.errors import UserError
from tests.autoconfig.test_serve import flag_value, launch, make_host, model_dir

RECIPE = 'option.kv_transfer_config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}\n'
YAML = "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 20\n"


def connector(argv: list[str]) -> dict[str, str]:
    return dict(json.loads(flag_value(argv, "--kv-transfer-config")))


def test_lmi_recipe_with_the_config_file_option_runs_our_connector_with_that_yaml(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, RECIPE + "option.lmcache_config_file=lmcache.yaml\n")
    (mdir / "lmcache.yaml").write_text(YAML)
    result = launch(tmp_path, None, mdir=mdir)
    assert result.mode == "file"
    assert connector(result.argv)["kv_connector"] == "LmiCacheConnector"
    assert result.argv.count("--kv-transfer-config") == 1
    assert result.env_set["LMCACHE_CONFIG_FILE"] == str(mdir / "lmcache.yaml")
    said = [line for line in result.summary if "LMI's LMCache recipe" in line]
    assert len(said) == 1 and "LMCacheConnectorV1" in said[0] and "lmcache.yaml" in said[0]


def test_lmi_recipe_with_the_env_variable(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, RECIPE)
    yaml_path = tmp_path / "elsewhere.yaml"
    yaml_path.write_text(YAML)
    result = launch(tmp_path, None, mdir=mdir, env={"LMCACHE_CONFIG_FILE": str(yaml_path)})
    assert result.mode == "file" and result.env["LMCACHE_CONFIG_FILE"] == str(yaml_path)
    assert connector(result.argv)["kv_connector"] == "LmiCacheConnector"


def test_lmi_recipe_yaml_is_checked_against_the_host(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, RECIPE + "option.lmcache_config_file=lmcache.yaml\n")
    (mdir / "lmcache.yaml").write_text("max_local_cpu_size: 4000\n")
    with pytest.raises(UserError, match="max_local_cpu_size") as info:
        launch(tmp_path, None, mdir=mdir)
    assert "option.lmcache_config_file" in str(info.value)


def test_lmi_recipe_without_a_yaml_is_auto_configured(tmp_path: Path) -> None:
    result = launch(tmp_path, 'option.kv_transfer_config={"kv_connector":"LMCacheConnectorV1"}\n')
    assert result.mode == "auto"
    assert connector(result.argv) == {"kv_connector": "LmiCacheConnector",
                                      "kv_connector_module_path": "lmi_cache.vllm_connector", "kv_role": "kv_both"}


def test_upstream_lmcache_only_when_asked_and_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (RECIPE.replace('"kv_both"', '"kv_both","kv_connector_extra_config":{"x":1}')
            + "option.lmcache_config_file=lmcache.yaml\noption.lmcache_engine=lmcache\n")
    mdir = model_dir(tmp_path, text)
    (mdir / "lmcache.yaml").write_text(YAML)
    with pytest.raises(UserError, match="lmcache package is not installed") as info:
        launch(tmp_path, None, mdir=mdir)
    assert "option.lmcache_engine" in str(info.value)
    fake = tmp_path / "site"
    (fake / "lmcache").mkdir(parents=True)
    (fake / "lmcache" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(fake))
    result = launch(tmp_path, None, mdir=mdir)
    assert connector(result.argv) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"x": 1}}


def test_lmi_simplified_env_vars(tmp_path: Path) -> None:
    env = {"TENSOR_PARALLEL_DEGREE": "4", "SM_NUM_GPUS": "2", "MAX_BATCH_SIZE": "64",
           "HF_MODEL_TRUST_REMOTE_CODE": "true", "HF_REVISION": "abc123", "MAX_CONCURRENT_REQUESTS": "100",
           "MAX_BATCH_PREFILL_TOKENS": "8192", "HF_MODEL_QUANTIZE": "fp8"}
    result = launch(tmp_path, "", host=make_host(4), env=env)
    assert flag_value(result.argv, "--tensor-parallel-size") == "4"  # TENSOR_PARALLEL_DEGREE beats SM_NUM_GPUS
    assert flag_value(result.argv, "--max-num-seqs") == "64"
    assert flag_value(result.argv, "--max-num-batched-tokens") == "8192"
    assert flag_value(result.argv, "--revision") == "abc123"
    assert flag_value(result.argv, "--quantization") == "fp8"
    assert "--trust-remote-code" in result.argv
    assert any("job_queue_size=100 ignored" in line for line in result.summary)
    # OPTION_* and serving.properties beat the simplified variables.
    result = launch(tmp_path, "option.max_rolling_batch_size=8\n", host=make_host(4),
                    env={**env, "OPTION_TENSOR_PARALLEL_DEGREE": "2"})
    assert flag_value(result.argv, "--tensor-parallel-size") == "2"
    assert flag_value(result.argv, "--max-num-seqs") == "8"


def test_tensor_parallel_defaults_to_every_gpu(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.lmcache_auto_config=true\n", host=make_host(4))
    assert flag_value(result.argv, "--tensor-parallel-size") == "4"
    assert "--data-parallel-size" not in result.argv
    assert any("LMI's default 'max'" in line for line in result.summary)


def test_tp1_on_eight_gpus_serves_eight_replicas(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.tensor_parallel_degree=1\n", host=make_host(8))
    assert flag_value(result.argv, "--data-parallel-size") == "8"
    assert "--tensor-parallel-size" not in result.argv
    assert any("8 replicas" in line for line in result.summary)
    one = launch(tmp_path, "option.tensor_parallel_degree=1\noption.data_parallel_degree=1\n", host=make_host(8))
    assert "--data-parallel-size" not in one.argv


@pytest.mark.parametrize(("server_keys", "replicas"), [("gpu.maxWorkers=2\n", "2"), ("load_on_devices=0\n", None),
                                                       ("load_on_devices=0;1;2;3\n", "4"),
                                                       ("load_on_devices=2;5\n", "2")])
def test_lmi_worker_limits_cap_the_replicas(tmp_path: Path, server_keys: str, replicas: str | None) -> None:
    result = launch(tmp_path, "option.tensor_parallel_degree=1\n" + server_keys, host=make_host(8))
    if replicas is None:
        assert "--data-parallel-size" not in result.argv
    else:
        assert flag_value(result.argv, "--data-parallel-size") == replicas
    if "load_on_devices" in server_keys:
        devices = server_keys.strip().split("=")[1].replace(";", ",")
        assert result.env_set["CUDA_VISIBLE_DEVICES"] == devices  # TP 1 workers: vLLM sees only LMI's devices


def test_load_on_devices_names_where_each_worker_starts(tmp_path: Path) -> None:
    # LMI starts one worker per listed device; a TP worker uses the GPUs from there on.
    result = launch(tmp_path, "load_on_devices=0\noption.tensor_parallel_degree=4\n", host=make_host(8))
    assert flag_value(result.argv, "--tensor-parallel-size") == "4" and "--data-parallel-size" not in result.argv
    assert result.env_set["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    result = launch(tmp_path, "load_on_devices=6\n", host=make_host(8))  # TP 'max': GPUs 6 and 7
    assert flag_value(result.argv, "--tensor-parallel-size") == "2"
    assert result.env_set["CUDA_VISIBLE_DEVICES"] == "6,7"
    with pytest.raises(UserError, match="load_on_devices='9': this host has GPUs 0-7"):
        launch(tmp_path, "load_on_devices=9\n", host=make_host(8))
    with pytest.raises(UserError, match="need GPUs 6, 7, 8, 9, this host has 0-7"):
        launch(tmp_path, "load_on_devices=6\noption.tensor_parallel_degree=4\n", host=make_host(8))


def test_with_the_cache_on_one_copy_unless_replicas_are_asked_for(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.tensor_parallel_degree=1\noption.lmcache_auto_config=true\n",
                    host=make_host(8, ram_gib=1024))
    assert "--data-parallel-size" not in result.argv
    assert any("LMI runs one worker when LMCache is on" in line for line in result.summary)
    result = launch(tmp_path, "option.tensor_parallel_degree=1\noption.data_parallel_degree=8\n"
                              "option.lmcache_auto_config=true\n", host=make_host(8, ram_gib=1024))
    assert flag_value(result.argv, "--data-parallel-size") == "8"
    plan = json.loads((tmp_path / "runtime" / "plan.json").read_text())
    assert plan["parallel"]["dp"] == 8 and plan["parallel"]["ranks_per_host"] == 8  # every replica has tiers


def test_replicas_beyond_the_gpus_are_refused_before_vllm(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data_parallel_degree=4 replicas x tp=4") as info:
        launch(tmp_path, "option.tensor_parallel_degree=4\noption.data_parallel_degree=4\n", host=make_host(8))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("optoin.lmcache_auto_config=true", "did you mean option.lmcache_auto_config?"),
        ("opton.tensor_parallel_degree=4", "did you mean option.tensor_parallel_degree?"),
        ("lmcache_auto_confg=true", "did you mean option.lmcache_auto_config?"),
    ],
)
def test_a_misspelt_prefix_is_an_error(tmp_path: Path, line: str, expected: str) -> None:
    with pytest.raises(UserError, match=expected):
        launch(tmp_path, line + "\n")


def test_an_engine_name_without_the_prefix_is_a_loud_note(tmp_path: Path) -> None:
    result = launch(tmp_path, "tensor_parallel_degree=4\n", host=make_host(4))
    said = [line for line in result.summary if "tensor_parallel_degree=4" in line]
    assert len(said) == 1 and "need the option. prefix" in said[0] and "write option.tensor_parallel_degree" in said[0]


def test_lmi_server_keys_and_dtype_values(tmp_path: Path) -> None:
    text = "engine=Python\ngpu.maxWorkers=1\nload_on_devices=0\noption.dtype=fp16\n"
    props = resolve_properties(model_dir(tmp_path, text), {})
    assert props.settings.dtype == "float16"
    result = launch(tmp_path, text)
    assert flag_value(result.argv, "--dtype") == "float16"


def test_lmcache_env_variables_are_named_checked_and_misspellings_flagged(tmp_path: Path) -> None:
    env = {"LMCACHE_CHUNK_SIZE": "'512'", "LMCACHE_CHUNCK_SIZE": "3", "LMCACHE_REMOTE_URL": "redis://u:pw@h:6379"}
    result = launch(tmp_path, "option.lmcache_auto_config=true\n", env=env)
    text = "\n".join(result.summary)
    said = [line for line in result.summary if "override" in line]
    assert said == ["warning: LMCACHE_CHUNK_SIZE, LMCACHE_REMOTE_URL override the LMCache YAML (the environment wins "
                    "over the file, as in LMCache)"]  # once, in one wording
    assert "chunk 512 tokens (LMCACHE_CHUNK_SIZE; planned: chunk " in text  # the summary shows what runs
    assert "LMCACHE_CHUNCK_SIZE: not an LMCache setting, ignored; did you mean LMCACHE_CHUNK_SIZE?" in text
    assert "pw@h" not in text
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(UserError, match="LMCACHE_MAX_LOCAL_CPU_SIZE"):
        launch(bad, "option.lmcache_auto_config=true\n", env={"LMCACHE_MAX_LOCAL_CPU_SIZE": "abc"})
    assert not (bad / "runtime").exists(), "a bad LMCACHE_* value fails before anything is written"
    off = launch(tmp_path, "", env={"LMCACHE_LOG_LEVEL": "DEBUG"})  # not a setting: it turns nothing on
    said = [line for line in off.summary if "set but the cache is off" in line]
    assert off.mode == "off" and len(said) == 1 and "LMCACHE_LOG_LEVEL" in said[0]


def test_tp_max_is_lowered_to_what_the_models_heads_allow(tmp_path: Path) -> None:
    # Qwen2.5-7B: 28 attention heads, 4 KV heads. vLLM refuses TP 8 (28 % 8) and TP 7 (7 % 4 KV heads).
    result = launch(tmp_path, "", host=make_host(8), model="qwen2.5-7b-instruct")
    assert flag_value(result.argv, "--tensor-parallel-size") == "4"
    assert flag_value(result.argv, "--data-parallel-size") == "2"
    assert any("'max' is 4, not 8" in line for line in result.summary)
    explicit = launch(tmp_path, "option.tensor_parallel_degree=2\n", host=make_host(8), model="qwen2.5-7b-instruct")
    assert flag_value(explicit.argv, "--tensor-parallel-size") == "2"  # a number is the user's choice


@pytest.mark.parametrize(("gpus", "heads", "expected"), [(8, (32, 8), 8), (6, (32, 8), 4), (8, (28, 4), 4),
                                                         (8, (64, 1), 8), (3, (40, 8), 2), (8, (12, 12), 6)])
def test_largest_fitting_tp(gpus: int, heads: tuple[int, int], expected: int) -> None:
    from autoconfig.serve.checks import largest_fitting_tp

    assert largest_fitting_tp(gpus, heads) == expected


@pytest.mark.parametrize(("line", "expected"), [
    ("option.sessions_expiraton=60", "did you mean option.sessions_expiration?"),
    ("option.enable_stateful_session=false", "did you mean option.enable_stateful_sessions?"),
    ("option.session_path=/tmp/s", "did you mean option.sessions_path?"),
    ("option.enable_adapter_formatter=true", "did you mean option.enable_adapter_formatters?"),
])
def test_a_misspelt_front_option_gets_a_did_you_mean(tmp_path: Path, line: str, expected: str) -> None:
    with pytest.raises(UserError, match=expected):
        launch(tmp_path, line + "\n")


def test_front_options_are_served_not_passed_to_vllm(tmp_path: Path) -> None:
    from autoconfig.lmi.to_vllm import map_lmi_options

    result = launch(tmp_path, "option.sessions_expiration=60\noption.enable_stateful_sessions=true\n")
    assert result.env_set["SAGEMAKER_SESSIONS_EXPIRATION"] == "60"
    assert not any("session" in arg for arg in result.argv)
    # The same check runs before a SageMaker deploy: the front's options are valid names there too.
    assert map_lmi_options({"sessions_expiration": "60", "enable_adapter_formatters": "true"}).values == {}
    note = launch(tmp_path, "sessions_expiration=60\n")
    assert any("write option.sessions_expiration" in line for line in note.summary)


def test_ignored_lmi_format_options_say_what_the_front_does_instead(tmp_path: Path) -> None:
    text = "option.tgi_compat=true\noption.output_formatter=jsonlines\noption.enable_streaming=true\n"
    notes = "\n".join(launch(tmp_path, text).summary)
    assert "option.tgi_compat=true ignored: /invocations answers in LMI's shapes" in notes
    assert "not TGI's (a list, server-sent events)" in notes
    assert "option.output_formatter=jsonlines ignored: /invocations answers in LMI's default formats" in notes
    assert "@output_formatter in adapters/<name>/model.py" in notes
    assert 'option.enable_streaming=true ignored: a request streams when it sends "stream": true' in notes
    assert "the OpenAI server formats" not in notes and "has its own schema" not in notes
