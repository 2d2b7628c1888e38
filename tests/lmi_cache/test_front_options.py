"""LMI session/adapter options -> serve's flags and environment; adapter folder checks (no vLLM)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmi_cache.front.adapters import check_adapter, registry_from_env, scan_adapters
from lmi_cache.front.options import MIDDLEWARE, FrontOptionError, front_launch


def test_sessions_are_on_by_default_with_lmis_expiry_and_path() -> None:
    launch = front_launch({}, None, prepare=False)
    assert launch.argv == ["--middleware", MIDDLEWARE]
    assert launch.env == {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_EXPIRATION": "1200",
                          "SAGEMAKER_SESSIONS_PATH": "/dev/shm/djl_sessions", "LMI_CACHE_MAX_SESSIONS": "10000",
                          "LMI_CACHE_MAX_REQUEST_BYTES": str(8 << 20)}


def test_sessions_can_be_turned_off_and_tuned(tmp_path: Path) -> None:
    env = front_launch({"enable_stateful_sessions": "false"}, None).env
    assert env["SAGEMAKER_ENABLE_STATEFUL_SESSIONS"] == "false" and "SAGEMAKER_SESSIONS_PATH" not in env
    env = front_launch({"sessions_expiration": "60", "sessions_path": str(tmp_path / "s"), "max_sessions": "5"},
                       None).env
    assert env["SAGEMAKER_SESSIONS_EXPIRATION"] == "60" and env["SAGEMAKER_SESSIONS_PATH"] == str(tmp_path / "s")
    assert env["LMI_CACHE_MAX_SESSIONS"] == "5"


@pytest.mark.parametrize("options, words", [
    ({"enable_stateful_sessions": "yes"}, ["OPTION_ENABLE_STATEFUL_SESSIONS", "true or false"]),
    ({"sessions_expiration": "10m"}, ["OPTION_SESSIONS_EXPIRATION", "seconds"]),
    ({"sessions_expiration": "0"}, ["OPTION_SESSIONS_EXPIRATION", "positive"]),
])
def test_bad_session_options_name_where_they_were_set(options: dict[str, str], words: list[str]) -> None:
    origins = {name: f"env OPTION_{name.upper()}" for name in options}
    with pytest.raises(FrontOptionError) as info:
        front_launch(options, None, origins)
    for word in words:
        assert word in str(info.value)


def _adapter(folder: Path, rank: int = 8, in_features: int = 64, truncate: bool = False) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(rank, in_features),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(in_features, rank)},
              str(folder / "adapter_model.safetensors"))
    if truncate:
        data = (folder / "adapter_model.safetensors").read_bytes()
        (folder / "adapter_model.safetensors").write_bytes(data[:-10])
    return folder


def test_a_good_adapter_passes_and_reports_its_rank(tmp_path: Path) -> None:
    assert check_adapter(_adapter(tmp_path / "a"), max_rank=16, hidden_size=64) == 8


@pytest.mark.parametrize("kwargs, max_rank, hidden, words", [
    ({"truncate": True}, 16, 64, "truncated"),
    ({"rank": 32}, 16, 64, "max_lora_rank=16"),
    ({"in_features": 32}, 16, 64, "another base model"),
])
def test_broken_adapters_are_refused_with_the_reason(tmp_path: Path, kwargs: dict[str, object], max_rank: int,
                                                     hidden: int, words: str) -> None:
    folder = _adapter(tmp_path / "a", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=words):
        check_adapter(folder, max_rank, hidden)


def test_config_problems_are_named(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    folder.mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        check_adapter(folder, 16, None)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        check_adapter(folder, 16, None)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "r": 8}))
    with pytest.raises(ValueError, match="only LORA"):
        check_adapter(folder, 16, None)


def test_the_adapters_folder_is_registered_when_lora_is_on(tmp_path: Path) -> None:
    _adapter(tmp_path / "adapters" / "good")
    (tmp_path / "adapters" / "bad").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    off = front_launch({}, tmp_path)
    assert "LMI_CACHE_ADAPTERS_DIR" not in off.env and any("enable_lora=true" in s for s in off.summary)
    on = front_launch({"enable_lora": "true"}, tmp_path)
    assert on.env["LMI_CACHE_ADAPTERS_DIR"] == str(tmp_path / "adapters")
    assert on.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert any(s.startswith("adapter good: registered") for s in on.summary)
    assert any(s.startswith("adapter bad: REFUSED") for s in on.summary)
    registry = registry_from_env(on.env)
    assert registry["good"].ok and not registry["bad"].ok
    assert sorted(scan_adapters(tmp_path / "adapters")) == ["bad", "good"]


def test_adapter_formatters_run_only_when_the_option_turns_them_on(tmp_path: Path) -> None:
    for name in ("plain", "fmt", "typo"):
        _adapter(tmp_path / "adapters" / name)
    (tmp_path / "adapters" / "fmt" / "model.py").write_text(
        "from djl_python.output_formatter import output_formatter\n"
        "@output_formatter\ndef out(response_data):\n    return response_data\n")
    (tmp_path / "adapters" / "typo" / "model.py").write_text("def f(:\n")
    off = front_launch({"enable_lora": "true"}, tmp_path)
    assert "LMI_CACHE_ADAPTER_FORMATTERS" not in off.env
    fmt_line = next(s for s in off.summary if s.startswith("adapter fmt:"))
    assert "registered" in fmt_line and "not run: set option.enable_adapter_formatters=true" in fmt_line
    on = front_launch({"enable_lora": "true", "enable_adapter_formatters": "true"}, tmp_path)
    assert on.env["LMI_CACHE_ADAPTER_FORMATTERS"] == "true"
    said = {s.split(":", 1)[0]: s for s in on.summary if s.startswith("adapter ")}
    assert said["adapter fmt"] == ("adapter fmt: registered (rank 8; loaded on first use; "
                                   "output formatter from model.py)")
    assert said["adapter plain"] == "adapter plain: registered (rank 8; loaded on first use)"
    assert said["adapter typo"].startswith("adapter typo: REFUSED (model.py line 1: ")
    with pytest.raises(FrontOptionError, match="OPTION_ENABLE_ADAPTER_FORMATTERS='yes': expected true or false"):
        front_launch({"enable_lora": "true", "enable_adapter_formatters": "yes"}, tmp_path,
                     {"enable_adapter_formatters": "env OPTION_ENABLE_ADAPTER_FORMATTERS"})
