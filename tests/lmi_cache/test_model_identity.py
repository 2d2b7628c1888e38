"""Tests for lmi_cache.keys.model_identity: the weights' identity that every cache key carries."""
from __future__ import annotations

import logging

import os
import random
import shutil
from pathlib import Path

import pytest

from lmi_cache.keys import model_identity as mi
from lmi_cache.errors import ConfigError

COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"
WEIGHT_BYTES = 8 * 1024 * 1024  # above the whole-file limit: sampled


def write_model(folder: Path, seed: int, weight_bytes: int = WEIGHT_BYTES) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 256}')
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (folder / "model.safetensors").write_bytes(random.Random(seed).randbytes(weight_bytes))
    return folder


def identity(path: Path, **env: str) -> str:
    return mi.model_identity(str(path), env=env)


def test_override_wins_and_reads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_model(tmp_path / "m", seed=1)
    monkeypatch.setattr(mi, "content_fingerprint", lambda path: pytest.fail("the override must not read files"))
    assert identity(model, LMI_CACHE_MODEL_VERSION=" release-7 ") == "user:release-7"


@pytest.mark.parametrize("bad", ["x" * 257, "tab\there", "new\nline"])
def test_bad_override_is_one_clear_error(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match="LMI_CACHE_MODEL_VERSION"):
        identity(tmp_path, LMI_CACHE_MODEL_VERSION=bad)


def test_hugging_face_snapshot_is_its_commit(tmp_path: Path) -> None:
    snapshot = write_model(tmp_path / "models--org--tiny" / "snapshots" / COMMIT_A, seed=1)
    assert identity(snapshot) == f"hf:{COMMIT_A}"
    assert identity(snapshot / "config.json") == f"hf:{COMMIT_A}"
    link = tmp_path / "served"
    link.symlink_to(snapshot)  # LMI often points option.model_id at a link into the cache
    assert identity(link) == f"hf:{COMMIT_A}"


def test_hub_id_resolves_through_the_cache_refs(tmp_path: Path) -> None:
    refs = tmp_path / "hub" / "models--org--tiny" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(COMMIT_A)
    (refs / "v2").write_text(COMMIT_B + "\n")
    hub = [str(tmp_path / "hub")]
    assert mi.model_identity("org/tiny", cache_dirs=hub, env={}) == f"hf:{COMMIT_A}"
    assert mi.model_identity("org/tiny", revision="v2", cache_dirs=hub, env={}) == f"hf:{COMMIT_B}"
    assert mi.model_identity("org/tiny", revision=COMMIT_B, env={}) == f"hf:{COMMIT_B}"


def test_unresolvable_hub_id_falls_back_to_name_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A library imported earlier in the session may configure logging with disable_existing_loggers.
    monkeypatch.setattr(mi.logger, "disabled", False)
    caplog.set_level(logging.WARNING, logger=mi.logger.name)
    got = mi.model_identity("org/never-downloaded", cache_dirs=[str(tmp_path)], env={"HF_HUB_OFFLINE": "1"})
    assert got.startswith("name:org/never-downloaded@")
    assert "LMI_CACHE_MODEL_VERSION" in caplog.text


def test_local_directory_fingerprint_follows_the_weights(tmp_path: Path) -> None:
    a = identity(write_model(tmp_path / "a", seed=1))
    assert a.startswith("content:")
    # The same files copied again (new inode, new mtime: a container start) keep the identity.
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    os.utime(tmp_path / "copy" / "model.safetensors", (1, 1))
    assert identity(tmp_path / "copy") == a
    # Other weights of the same size and architecture at the same path: a new identity.
    write_model(tmp_path / "a", seed=2)
    assert identity(tmp_path / "a") != a


def test_config_change_changes_identity_but_serving_files_do_not(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", seed=1)
    before = identity(model)
    (model / "serving.properties").write_text("option.max_rolling_batch_size=64\n")
    (model / "lmcache.yaml").write_text("chunk_size: 256\n")
    (model / ".lock").write_text("")
    assert identity(model) == before
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 512}')
    assert identity(model) != before


def test_a_changed_page_in_the_middle_of_a_weight_file_is_seen(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", seed=1)
    before = identity(model)
    offset = mi.sample_ranges(WEIGHT_BYTES)[5][0]
    with open(model / "model.safetensors", "r+b") as handle:
        handle.seek(offset)
        handle.write(b"\xff" * 16)
    assert identity(model) != before


def test_sampling_reads_a_bounded_amount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with open(model / name, "wb") as handle:
            handle.truncate(8 << 30)  # 8 GiB each, sparse
    read_bytes = 0
    real_pread = os.pread

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        nonlocal read_bytes
        data = real_pread(fd, length, offset)
        read_bytes += len(data)
        return data

    monkeypatch.setattr(mi.os, "pread", counting_pread)
    assert identity(model).startswith("content:")
    assert read_bytes < 2 * 256 * 1024  # well under 1 MiB for 16 GiB of weights


def test_sample_ranges_cover_head_middle_and_tail() -> None:
    assert mi.sample_ranges(100) == [(0, 100)]
    size = (1 << 30) + 123
    ranges = mi.sample_ranges(size)
    assert ranges[0] == (0, 64 * 1024)
    assert ranges[-1][0] + ranges[-1][1] == size
    assert all(offset % 4096 == 0 and 0 <= offset < size for offset, _ in ranges)
    offsets = [offset for offset, _ in ranges]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


def test_unreadable_weight_file_still_gives_an_identity(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", seed=1)
    (model / "broken.safetensors").symlink_to(tmp_path / "missing")
    assert identity(model).startswith("content:")


def test_served_identity_adds_settings_that_change_the_computation(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    monkeypatch.delenv("LMI_CACHE_MODEL_VERSION", raising=False)
    model = write_model(tmp_path / "m", seed=1)

    def served(**fields: object) -> str:
        base = {"model": str(model), "revision": None, "dtype": "torch.bfloat16", "quantization": None,
                "hf_overrides": None}
        return mi.served_model_identity(SimpleNamespace(**{**base, **fields}))

    plain = served()
    assert plain == identity(model) + "|dtype=bfloat16"
    variants = {served(dtype="torch.float16"), served(quantization="fp8"),
                served(hf_overrides={"rope_scaling": {"factor": 2.0}}), served(hf_overrides={"rope_theta": 1e6})}
    assert len(variants | {plain}) == 5
    assert served(hf_overrides={"a": 1, "b": 2}) == served(hf_overrides={"b": 2, "a": 1})
