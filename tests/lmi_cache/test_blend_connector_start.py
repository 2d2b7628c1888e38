"""Blending at the connector's start: settings from YAML and env, and a model blending does not cover is refused."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lmi_cache.blend.settings import BlendConfigError, load_blend_settings


def test_settings_come_from_the_yaml_and_env_wins(tmp_path: Path) -> None:
    yaml_path = tmp_path / "lmcache.yaml"
    yaml_path.write_text("chunk_size: 256\nenable_blending: true\nblend_recompute_ratios: [0.3]\nblend_min_tokens: 64\n")
    settings = load_blend_settings({"LMCACHE_CONFIG_FILE": str(yaml_path), "LMCACHE_BLEND_MIN_TOKENS": "'32'"})
    assert settings.enabled and settings.recompute_ratios == (0.3,) and settings.min_tokens == 32
    assert not load_blend_settings({}).enabled


def test_bad_blend_values_are_one_line_errors() -> None:
    with pytest.raises(BlendConfigError, match="blend_recompute_ratios"):
        load_blend_settings({"LMCACHE_ENABLE_BLENDING": "true", "LMCACHE_BLEND_RECOMPUTE_RATIOS": "2"})


@pytest.mark.vllm
def test_a_model_blending_does_not_cover_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmi_cache.vllm_connector import LmiCacheConnector

    monkeypatch.setenv("LMCACHE_ENABLE_BLENDING", "true")
    hf_config = SimpleNamespace(to_dict=lambda: {"model_type": "gpt2"}, num_hidden_layers=12)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config, model="org/gpt2-like"))
    with pytest.raises(BlendConfigError, match="model_type 'gpt2'.*turn enable_blending off"):
        LmiCacheConnector(vllm_config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]
