"""Start-up refusals: an unknown KV layout and a chunk size that is not a multiple of the block size."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_support import DOCS, JobFailed, cache_env, gen_phase, prompts, run_job


@pytest.fixture(scope="module")
def vllm_config(tiny_model: Path, monkeypatch_module: pytest.MonkeyPatch) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    args = EngineArgs(
        model=str(tiny_model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        kv_transfer_config=KVTransferConfig(
            kv_connector="LmiCacheConnector", kv_connector_module_path="lmi_cache.vllm_connector", kv_role="kv_both"
        ),
    )
    return args.create_engine_config()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    patcher = pytest.MonkeyPatch()
    yield patcher
    patcher.undo()


def test_chunk_size_must_be_a_multiple_of_the_block_size(vllm_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmi_cache.errors import ConfigError
    from lmi_cache.vllm_connector import LmiCacheConnector

    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "200")
    with pytest.raises(ConfigError) as err:
        LmiCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, None)
    assert "chunk_size" in str(err.value) and "\n" not in str(err.value)


def test_connector_refuses_unknown_layout_and_accepts_cpu_layout(vllm_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmi_cache.transfer.layouts import KvLayoutError
    from lmi_cache.vllm_connector import LmiCacheConnector

    for key, value in cache_env(None, cpu_gib=0.05).items():
        monkeypatch.setenv(key, value)
    connector = LmiCacheConnector(vllm_config, KVConnectorRole.WORKER, None)
    # 7M model: 2 KV heads of 32, block 128. A flash-attn tensor with a wrong head size:
    with pytest.raises(KvLayoutError, match="unknown layout"):
        connector.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(2, 6, 128, 2, 48) for i in range(4)})
    whole = torch.zeros(4, 6, 2, 128, 64)
    connector.register_kv_caches({f"model.layers.{i}.self_attn.attn": whole[i] for i in range(4)})
    assert connector.worker_side is not None and connector.worker_side.layout is not None
    assert connector.worker_side.layout.kind == "cpu"
    connector.shutdown()


def test_vllm_start_is_refused_for_an_unknown_layout(tiny_model: Path, e2e_dir: Path) -> None:
    """Real vLLM start-up, with the recogniser patched to know no layout: start fails, one clear line."""
    job = {
        "model": str(tiny_model),
        "connector": True,
        "patch": "unknown_layout",
        "env": cache_env(None),
        "phases": [gen_phase("never", prompts(DOCS[:1]))],
    }
    with pytest.raises(JobFailed) as err:
        run_job(job, e2e_dir / "unknown-layout")
    assert err.value.returncode != 0
    assert "unknown layout" in err.value.output and "refusing to start" in err.value.output
