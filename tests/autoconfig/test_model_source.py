"""Model resolution (dir / file / HF cache / hub), weights size and the parameter estimate."""
from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from autoconfig.model.kv import ModelConfigError
from autoconfig.model import source
from autoconfig.model.source import (
    ModelNotFoundError,
    estimate_num_params,
    hf_hub_cache_dir,
    load_model_info,
    read_config,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
LLAMA = FIXTURES / "llama-3.1-8b-instruct"


@pytest.fixture(autouse=True)
def _clean_hf_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # never read the real ~/.cache


def model_dir(tmp_path: Path, fixture: Path = LLAMA) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(fixture / "config.json", d / "config.json")
    return d


def fake_hf_cache(hub: Path, model_id: str, *, revision: str = "abc123", ref: bool = True,
                  weights: dict[str, int] | None = None, config: Path = LLAMA / "config.json") -> Path:
    """The huggingface_hub layout: blobs/, snapshots/<rev>/ symlinks, refs/main."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    files = {config.name: config.read_bytes()}
    files.update({name: b"\0" * size for name, size in (weights or {}).items()})
    for i, (name, data) in enumerate(files.items()):
        blob = repo / "blobs" / f"{revision}-{i}"
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return snap


def test_directory_and_config_file(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    by_dir = load_model_info(str(d))
    by_file = load_model_info(str(d / "config.json"))
    assert by_dir.config_path == by_file.config_path == str(d / "config.json")
    assert by_dir.name == "model" and by_dir.kv.layout.kv_bytes_per_token == 131072
    assert by_dir.kv.layout.model_name == "model"


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json") as err:
        load_model_info(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        load_model_info(str(tmp_path / "nope" / "x"))


@pytest.mark.parametrize("how", ["HF_HUB_CACHE", "HF_HOME", "hf_home", "XDG_CACHE_HOME", "default"])
def test_hf_cache_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    root = tmp_path / "cache"
    hub = {"HF_HUB_CACHE": root, "HF_HOME": root / "hub", "hf_home": root / "hub",
           "XDG_CACHE_HOME": root / "huggingface" / "hub",
           "default": tmp_path / "home" / ".cache" / "huggingface" / "hub"}[how]
    if how in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(how, str(root))
    snap = fake_hf_cache(hub, "meta-llama/Llama-3.1-8B-Instruct")
    info = load_model_info("meta-llama/Llama-3.1-8B-Instruct", hf_home=str(root) if how == "hf_home" else None)
    assert Path(info.config_path) == snap / "config.json"
    assert info.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert any("refs/main = abc123" in n for n in info.notes)


def test_hf_cache_follows_refs_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    old = fake_hf_cache(tmp_path, "org/m", revision="old", ref=False)
    fake_hf_cache(tmp_path, "org/m", revision="new")
    os.utime(old / "config.json", (4e9, 4e9), follow_symlinks=True)  # refs/main wins over a newer snapshot
    assert Path(load_model_info("org/m").config_path).parent.name == "new"


def test_hf_cache_without_refs_uses_newest_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    old = fake_hf_cache(tmp_path, "org/m", revision="r1", ref=False)
    new = fake_hf_cache(tmp_path, "org/m", revision="r2", ref=False)
    os.utime(old / "config.json", (1000, 1000), follow_symlinks=True)
    os.utime(new / "config.json", (2000, 2000), follow_symlinks=True)
    info = load_model_info("org/m")
    assert Path(info.config_path).parent.name == "r2" and any("newest snapshot" in n for n in info.notes)


def test_not_cached_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as err:
        load_model_info("org/not-here")
    message = str(err.value)
    assert "not in the local Hugging Face cache" in message and "HF_HOME" in message
    assert str(tmp_path) in message and "\n" not in message


def test_network_fetches_only_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    calls: list[dict[str, Any]] = []
    downloaded = model_dir(tmp_path) / "config.json"

    def hf_hub_download(**kwargs: Any) -> str:
        calls.append(kwargs)
        return str(downloaded)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    monkeypatch.setattr(source, "_hub_unreachable", lambda: None)  # the Hub answers (faked)
    info = load_model_info("org/remote", allow_network=True)
    assert calls == [{"repo_id": "org/remote", "filename": "config.json", "cache_dir": None}]
    assert info.config_path == str(downloaded) and info.weights_source.startswith("estimated from config")


def test_a_hub_repository_without_config_json_is_read_from_params_json(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    asked: list[str] = []

    class EntryNotFoundError(OSError):  # huggingface_hub's name for a file the repository does not have
        pass

    def hf_hub_download(**kwargs: Any) -> str:
        asked.append(kwargs["filename"])
        if kwargs["filename"] == "config.json":
            raise EntryNotFoundError("404 Client Error: Entry Not Found")
        return str(FIXTURES / "mistral-large-3" / "params.json")

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    monkeypatch.setattr(source, "_hub_unreachable", lambda: None)  # the Hub answers (faked)
    info = load_model_info("mistralai/Large-3", allow_network=True)
    assert asked == ["config.json", "params.json"] and info.kv.layout.is_mla


def test_network_error_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))

    def hf_hub_download(**kwargs: Any) -> str:
        raise OSError("401 Client Error\nmore details")

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    monkeypatch.setattr(source, "_hub_unreachable", lambda: None)
    with pytest.raises(ModelNotFoundError, match="401 Client Error") as err:
        load_model_info("org/gated", allow_network=True)
    assert "\n" not in str(err.value)


def test_an_unreachable_hub_is_found_by_one_short_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listener.getsockname()[1]}")
        assert source._hub_unreachable() is None
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert (source._hub_unreachable() or "").startswith("127.0.0.1: ")


# --- weights size ---

def test_weights_from_index(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16060522496}}))
    (d / "model-00001-of-00004.safetensors").write_bytes(b"\0" * 10)
    info = load_model_info(str(d))
    assert info.weights_bytes == 16060522496 and info.weights_source == "safetensors index metadata.total_size"


def test_weights_from_cached_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    fake_hf_cache(tmp_path, "org/m", weights={"model-1.safetensors": 1000, "model-2.safetensors": 234,
                                               "consolidated.safetensors": 1234})
    info = load_model_info("org/m")
    assert info.weights_bytes == 1234 and info.weights_source == "sum of *.safetensors/*.bin file sizes"


def test_weights_from_bin_files(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (d / "pytorch_model.bin").write_bytes(b"\0" * 500)
    (d / "training_args.bin").write_bytes(b"\0" * 7)
    assert load_model_info(str(d)).weights_bytes == 500


def test_weights_estimated(tmp_path: Path) -> None:
    info = load_model_info(str(model_dir(tmp_path)))
    params = estimate_num_params(json.loads((LLAMA / "config.json").read_text()))
    assert info.weights_bytes == params * 2
    assert info.weights_source == f"estimated from config: {params} params x 2 bytes"
    fp8 = load_model_info(str(FIXTURES / "deepseek-v3"))  # fp8 weights: one byte per parameter
    assert fp8.weights_source.endswith("x 1 bytes") and 600e9 < fp8.weights_bytes < 720e9
    ct = load_model_info(str(FIXTURES / "llama-3.1-8b-instruct-fp8-kv"))  # compressed-tensors, 8-bit weights
    assert ct.weights_bytes == params and ct.kv.layout.kv_dtype == "fp8"


@pytest.mark.parametrize("fixture,published", [
    ("llama-3.1-8b-instruct", 8.03e9),
    ("qwen2.5-72b-instruct", 72.7e9),
    ("qwen2.5-7b-instruct", 7.61e9),
    ("qwen3-30b-a3b", 30.5e9),  # MoE: all 128 experts count
    ("deepseek-v3", 671e9),  # MLA + MoE, main model without the MTP layer
    ("gemma-2-9b-it", 9.24e9),  # tied embeddings
    ("llama-3.3-70b-instruct", 70.6e9),
])
def test_param_estimate_within_10_percent(fixture: str, published: float) -> None:
    estimate = estimate_num_params(json.loads((FIXTURES / fixture / "config.json").read_text()))
    assert abs(estimate - published) / published < 0.10, estimate


def test_modelopt_sidecar_sets_kv_dtype(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (d / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.19.0"},
         "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    info = load_model_info(str(d))
    assert info.kv.layout.kv_dtype == "fp8_e4m3" and any("hf_quant_config.json" in n for n in info.notes)
    assert info.weights_source.endswith("x 1 bytes")


# --- unreadable files ---

def test_invalid_json(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 32,\n  oops}')
    with pytest.raises(ModelConfigError, match="not valid JSON \\(line 2 column 3") as err:
        read_config(bad)
    assert str(err.value).startswith(str(bad)) and "\n" not in str(err.value)


def test_non_object_file(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="expected a JSON object, got list"):
        load_model_info(str(bad))


def test_bad_key_names_the_file(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError) as err:
        load_model_info(str(d))
    assert str(err.value).startswith(str(d / "config.json")) and "'num_hidden_layers'" in str(err.value)


def test_hf_hub_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home_hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    assert hf_hub_cache_dir() == tmp_path / "hub_cache"
    assert hf_hub_cache_dir(str(tmp_path / "explicit")) == tmp_path / "explicit" / "hub"
    monkeypatch.delenv("HF_HUB_CACHE")
    assert hf_hub_cache_dir() == tmp_path / "home_hf" / "hub"


def test_hub_access_follows_huggingface_hub_env_rules() -> None:
    from autoconfig.model.source import hub_access_from_env

    assert hub_access_from_env({}) == (None, True)
    assert hub_access_from_env({"HF_HOME": "/h"}) == ("/h", True)
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub.
    assert hub_access_from_env({"HF_HOME": "/h", "HF_HUB_CACHE": "/c"}) == (None, True)
    assert hub_access_from_env({"HF_HUB_OFFLINE": "1"}) == (None, False)
    assert hub_access_from_env({"HF_HUB_OFFLINE": "0"}) == (None, True)


# ---------------------------------------------------------------- hostile config.json files

_BASE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 100}


@pytest.mark.parametrize(
    "raw, needle",
    [
        ('{"num_hidden_layers": NaN}', "NaN"),
        ('{"hidden_size": Infinity}', "Infinity"),
        ('{"hidden_size": ' + "9" * 5000 + "}", "too many digits"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
        (b"\xff\xfe{}", "not UTF-8 text"),
    ],
)
def test_hostile_json_is_one_line(tmp_path: Path, raw: str | bytes, needle: str) -> None:
    (tmp_path / "config.json").write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    with pytest.raises(ModelConfigError) as info:
        load_model_info(str(tmp_path))
    assert needle in str(info.value) and "config.json" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"num_hidden_layers": 1e15, "num_experts": 8}, "num_hidden_layers"),  # used to loop for ever
        ({"num_hidden_layers": float("nan")}, None),  # json.dumps writes NaN
        ({"hidden_size": 1e308}, "hidden_size"),
        ({"num_attention_heads": True}, "num_attention_heads"),
        ({"num_experts": "abc"}, "num_experts"),
        ({"vocab_size": [1]}, "vocab_size"),
        ({"intermediate_size": {"a": 1}}, "intermediate_size"),
        ({"num_experts": 8, "moe_intermediate_size": -5}, "moe_intermediate_size"),
    ],
)
def test_garbage_fields_are_one_line_errors(tmp_path: Path, change: dict[str, Any], needle: str | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_BASE, **change}))
    with pytest.raises(ModelConfigError) as info:
        load_model_info(str(tmp_path))
    assert (needle or "NaN") in str(info.value) and "\n" not in str(info.value)


def test_moe_layer_count_ignores_a_zero_step_and_garbage_dense_list(tmp_path: Path) -> None:
    config = {**_BASE, "num_experts": 8, "decoder_sparse_step": 0, "mlp_only_layers": ["x", None, 1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model_info(str(tmp_path)).weights_bytes > 0


def test_moe_layer_count_matches_the_rule() -> None:
    from autoconfig.model.params import _moe_layer_count

    def brute(layers: int, first: int, step: int, only: list[int]) -> int:
        return sum(1 for i in range(layers) if i >= first and i not in only and (i + 1) % step == 0)

    for layers, first, step, only in [(48, 0, 1, []), (61, 3, 1, []), (48, 0, 2, [5, 7, 100]), (10, 20, 1, []),
                                      (24, 1, 3, [2, 5, 8, 8])]:
        assert _moe_layer_count({"mlp_only_layers": only}, layers, first, step) == brute(layers, first, step, only)


def test_corrupt_index_total_size_falls_back(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_BASE))
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {"total_size": ' + "9" * 30 + "}}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    assert load_model_info(str(tmp_path)).weights_bytes == 1000


def test_hf_cache_ref_cannot_escape_the_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("../../../../elsewhere")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    shutil.copy(LLAMA / "config.json", repo / "snapshots" / "abc" / "config.json")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    info = load_model_info("org/m")
    assert "snapshots/abc" in info.config_path


@pytest.mark.parametrize("ref", [True, False])
def test_hf_cache_of_a_mistral_format_model_reads_params_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              ref: bool) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snap = fake_hf_cache(tmp_path, "mistralai/Large-3", config=LLAMA.parent / "mistral-large-3" / "params.json", ref=ref)
    info = load_model_info("mistralai/Large-3")
    assert info.config_path == str(snap / "params.json")
    assert info.kv.layout.kv_bytes_per_token == 61 * 576 * 2
