"""LmiCacheConnector's wiring of the weights' identity and the data-parallel replica into the disk tier.

Driven with a small fake VllmConfig (the real thing is covered end to end in
tests/e2e): the scheduler of replica 1 with TP=2 seeds its index from its own
ranks only, prunes its ranks beyond the world, and keys carry the identity;
its workers write to ``rank<r>-dp1``.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmi_cache.keys.hashing import ChunkKey, KeySpace
from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.engine import CacheEngine
from lmi_cache.tiers.disk.ranks import rank_label

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from lmi_cache.vllm_connector.connector import LmiCacheConnector  # noqa: E402
from engine_verbs import save  # noqa: E402

CHUNK = 16
TOKENS = list(range(4 * CHUNK))
SPACE = KeySpace("x", "float32", "t", CHUNK, tp_size=4)  # four ranks' distinct keys to fill directories with


def fake_vllm_config(model_dir: Path, dp_index: int, tp_size: int = 2) -> Any:
    model_config = SimpleNamespace(
        model=str(model_dir), dtype="torch.float32", revision=None, quantization=None, hf_overrides=None,
        use_mla=False, get_num_kv_heads=lambda parallel: 2, get_head_size=lambda: 32,
    )
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        cache_config=SimpleNamespace(block_size=CHUNK, cache_dtype="auto"),
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=1,
                                        data_parallel_index=dp_index, data_parallel_rank=0),
        load_config=SimpleNamespace(download_dir=None),
    )


def fill(disk: Path, label: str, keys: list[ChunkKey]) -> set[bytes]:
    config = CacheConfig(chunk_size=CHUNK, local_cpu=False, local_disk=(str(disk),), max_local_disk_size=0.01)
    with CacheEngine(config, rank_label=label) as engine:
        for key in keys:
            assert save(engine, key, torch.zeros(4, 16))
        engine.flush()
    return {k.digest for k in keys}


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    disk = tmp_path / "disk"
    for key in list(os.environ):
        if key.startswith("LMCACHE_") or key.startswith("LMI_CACHE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", str(CHUNK))
    monkeypatch.setenv("LMCACHE_LOCAL_CPU", "false")
    monkeypatch.setenv("LMCACHE_LOCAL_DISK", f"file://{disk}/")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_DISK_SIZE", "0.01")
    return model, disk


def test_scheduler_of_a_replica_seeds_from_its_own_live_ranks(setup: tuple[Path, Path]) -> None:
    model, disk = setup
    own = fill(disk, rank_label(0, 1), SPACE.keys(TOKENS, 0)) | fill(disk, rank_label(1, 1), SPACE.keys(TOKENS, 1))
    other_replica = fill(disk, rank_label(0, 0), SPACE.keys(TOKENS, 2))
    orphan = fill(disk, rank_label(2, 1), SPACE.keys(TOKENS, 3))  # from a TP=4 past
    connector = LmiCacheConnector(fake_vllm_config(model, dp_index=1), KVConnectorRole.SCHEDULER, None)
    book = connector.scheduler_side.directory.books[0]  # type: ignore[union-attr]  # LMCACHE_LOCAL_CPU=false
    assert book.name == "disk" and all(book.holds(d) for d in own)
    assert not any(book.knows(d) for d in other_replica | orphan)
    assert not (disk / "rank2-dp1").exists() and (disk / "rank0").exists()
    assert connector._deployment.model_identity.startswith("content:") and "|dtype=float32" in connector._deployment.model_identity


def test_identity_changes_the_scheduler_keys(setup: tuple[Path, Path]) -> None:
    model, _ = setup
    before = LmiCacheConnector(fake_vllm_config(model, 0), KVConnectorRole.SCHEDULER, None)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}')
    after = LmiCacheConnector(fake_vllm_config(model, 0), KVConnectorRole.SCHEDULER, None)
    key_before = before.key_space("t").keys(TOKENS, 0)[0]
    key_after = after.key_space("t").keys(TOKENS, 0)[0]
    assert key_before.digest != key_after.digest
    assert before.key_space("t").keys(TOKENS, 0)[0] == key_before  # and nothing else changes them


def test_workers_of_a_replica_write_their_own_directory(setup: tuple[Path, Path]) -> None:
    model, disk = setup
    connector = LmiCacheConnector(fake_vllm_config(model, dp_index=1), KVConnectorRole.WORKER, None)
    side = connector.worker_side
    assert side is not None
    engine = side._engine_factory()  # what register_kv_caches calls (rank 0 without distributed state)
    try:
        assert save(engine, SPACE.keys(TOKENS, 0)[0], torch.zeros(4, 16))
        engine.flush()
    finally:
        engine.close()
    assert sorted(p.name for p in disk.iterdir()) == ["rank0-dp1"]


def test_enable_blending_turns_blending_on_in_the_one_connector(
    setup: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lmi_cache.blend.connector import LmiBlendConnector as EarlierPath
    from lmi_cache.vllm_connector import LmiBlendConnector, connector

    model, _ = setup
    config = fake_vllm_config(model, 0)
    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4}
    config.model_config.hf_config = SimpleNamespace(to_dict=lambda: llama, num_hidden_layers=4)
    assert LmiCacheConnector(config, KVConnectorRole.WORKER, None).blending is None
    # A library imported earlier in the session may configure logging with disable_existing_loggers.
    monkeypatch.setattr(connector.logger, "disabled", False)
    caplog.set_level("WARNING", logger=connector.logger.name)
    assert LmiBlendConnector(config, KVConnectorRole.WORKER, None).blending is not None  # the earlier name: forced on
    assert EarlierPath is LmiBlendConnector
    assert sum("LmiBlendConnector is deprecated" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setenv("LMCACHE_ENABLE_BLENDING", "true")
    on = LmiCacheConnector(config, KVConnectorRole.WORKER, None)
    assert on.blending is not None and on.blending.context.settings.enabled
