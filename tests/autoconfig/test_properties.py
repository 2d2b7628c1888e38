"""serving.properties parsing (Java syntax) and LMI option resolution."""
from __future__ import annotations

from pathlib import Path

import pytest

from autoconfig.lmi.java_properties import PropertiesSyntaxError, parse_properties
from autoconfig.lmi.properties import PropertiesError, resolve_properties
from lmi_cache.errors import UserError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a=1\nb:2\nc 3\n", {"a": "1", "b": "2", "c": "3"}),
        ("  a = 1  \n", {"a": "1  "}),  # leading blanks dropped, trailing kept (Java)
        ("# comment\n! bang\n\n   # indented comment\na=1", {"a": "1"}),
        ("a=x#y\n", {"a": "x#y"}),  # '#' mid-line is data
        ("a=one \\\n    two \\\n  three\n", {"a": "one two three"}),
        ("a=ends\\\\\nb=2\n", {"a": "ends\\", "b": "2"}),  # even backslashes: no continuation
        ("a=\\t\\n\\u0041\\\\\\=\\:x\n", {"a": "\t\nA\\=:x"}),
        ("key\\ with\\ spaces = v\n", {"key with spaces": "v"}),
        ("a\\=b=c\n", {"a=b": "c"}),
        ("a = b = c\n", {"a": "b = c"}),
        ("empty\n", {"empty": ""}),
        ("a=1\r\nb=2\rc=3", {"a": "1", "b": "2", "c": "3"}),
        ("a=1\na=2\n", {"a": "2"}),  # later wins
        ("# comment \\\na=1\n", {"a": "1"}),  # comments do not continue
        ("a=x\\\n# not a comment\n", {"a": "x# not a comment"}),
        ("\ufeffa=1", {"a": "1"}),
    ],
)
def test_java_properties_syntax(text: str, expected: dict[str, str]) -> None:
    assert parse_properties(text) == expected


def test_bad_unicode_escape_names_file_and_line() -> None:
    with pytest.raises(PropertiesSyntaxError, match=r"sp.properties: line 2: malformed \\uXXXX"):
        parse_properties("a=1\nb=\\u12G4\n", "sp.properties")


def _model_dir(tmp_path: Path, text: str | None) -> Path:
    if text is not None:
        (tmp_path / "serving.properties").write_text(text)
    return tmp_path


def test_file_and_env_are_the_same_setting_and_file_wins(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.tensor_parallel_degree=4\nengine=Python\n")
    env = {"OPTION_TENSOR_PARALLEL_DEGREE": "2", "OPTION_MAX_MODEL_LEN": "8192", "OPTION_ROLLING_BATCH": "vllm"}
    props = resolve_properties(mdir, env)
    assert props.settings.tp == 4
    assert props.settings.max_model_len == 8192
    assert props.options["tensor_parallel_degree"].source == str(mdir / "serving.properties")
    assert props.options["max_model_len"].source == "environment"
    assert props.options["rolling_batch"].value == "vllm"  # unknown options are kept for serve
    assert props.other_properties == {"engine": "Python"}
    assert any("tensor_parallel_degree = 4" in line for line in props.summary_lines())


def test_dotted_option_names_match_env_underscores(tmp_path: Path) -> None:
    props = resolve_properties(_model_dir(tmp_path, "option.some.thing=a\n"), {"OPTION_SOME_THING": "b"})
    assert props.options["some_thing"].value == "a"


def test_sm_num_gpus_and_hf_model_id_only_when_unset(tmp_path: Path) -> None:
    env = {"SM_NUM_GPUS": "8", "HF_MODEL_ID": "org/model"}
    props = resolve_properties(_model_dir(tmp_path, None), env)
    assert props.settings.tp == 8 and props.model_id == "org/model"
    props = resolve_properties(_model_dir(tmp_path, "option.tensor_parallel_degree=2\noption.model_id=/m\n"), env)
    assert props.settings.tp == 2 and props.model_id == "/m"


def test_tp_max_is_gpu_count(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.tensor_parallel_degree=max\n")
    assert resolve_properties(mdir, {}, gpu_count=8).settings.tp == 8
    assert resolve_properties(mdir, {}, gpu_count=0).settings.tp == 1


@pytest.mark.parametrize("value", ["TRUE", "true", "True"])
def test_auto_config_true_any_case(tmp_path: Path, value: str) -> None:
    props = resolve_properties(_model_dir(tmp_path, f"option.lmcache_auto_config={value}\n"), {})
    assert props.auto_config is True


def test_auto_config_garbage_is_an_error_naming_file_and_key(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, "option.lmcache_auto_config=yes\n")
    with pytest.raises(PropertiesError) as err:
        resolve_properties(mdir, {})
    assert str(mdir / "serving.properties") in str(err.value)
    assert "option.lmcache_auto_config='yes'" in str(err.value) and "true or false" in str(err.value)


def test_env_error_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(PropertiesError, match="environment variable OPTION_GPU_MEMORY_UTILIZATION='1.5'"):
        resolve_properties(tmp_path, {"OPTION_GPU_MEMORY_UTILIZATION": "1.5"})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("option.tensor_parallel_degree=two", "positive integer or 'max'"),
        ("option.pipeline_parallel_degree=0", "positive integer"),
        ("option.max_model_len=1e4", "positive integer"),
        ("option.gpu_memory_utilization=0", r"\(0, 1\]"),
        ("option.lmcache_max_local_cpu_size=-1", "GiB per rank"),
        ("option.lmcache_max_local_disk_size=lots", "GiB per rank"),
        ("option.lmcache_local_disk=relative/dir", "absolute"),
        ("option.lmcache_chunk_size=-256", "positive integer"),
        ("option.lmcache_use_odirect=1", "true or false"),
        ("option.kv_cache_dtype=fp 8", "one word"),
    ],
)
def test_bad_values_are_errors(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(PropertiesError, match=message):
        resolve_properties(_model_dir(tmp_path, line + "\n"), {})


def test_tier_overrides_are_typed(tmp_path: Path) -> None:
    text = ("option.lmcache_max_local_cpu_size=20.5\noption.lmcache_max_local_disk_size=0\n"
            "option.lmcache_local_disk=file:///mnt/nvme/kv/\noption.lmcache_chunk_size=512\n"
            "option.lmcache_use_odirect=FALSE\noption.kv_cache_dtype=fp8\noption.data_parallel_degree=2\n")
    s = resolve_properties(_model_dir(tmp_path, text), {}).settings
    assert s.overrides.cpu_size_gib == 20.5 and s.overrides.disk_size_gib == 0.0
    assert s.overrides.disk_path == "/mnt/nvme/kv/" and s.overrides.chunk_size == 512
    assert s.overrides.use_odirect is False and s.kv_cache_dtype == "fp8" and s.dp == 2


def test_config_file_relative_to_model_dir_and_exclusive_with_auto(tmp_path: Path) -> None:
    props = resolve_properties(_model_dir(tmp_path, "option.lmcache_config_file=conf/lmcache.yaml\n"), {})
    assert props.config_file == tmp_path / "conf" / "lmcache.yaml" and not props.auto_config
    with pytest.raises(UserError, match="both set"):
        resolve_properties(tmp_path, {"OPTION_LMCACHE_AUTO_CONFIG": "true"})
    abs_props = resolve_properties(tmp_path / "missing", {"OPTION_LMCACHE_CONFIG_FILE": "/etc/lm.yaml"})
    assert abs_props.config_file == Path("/etc/lm.yaml") and abs_props.properties_path is None


def test_defaults_without_any_setting(tmp_path: Path) -> None:
    props = resolve_properties(tmp_path, {})
    assert props.properties_path is None and not props.auto_config and props.config_file is None
    assert props.settings.tp == 1 and props.settings.gpu_memory_utilization == 0.9
    assert props.options == {}
