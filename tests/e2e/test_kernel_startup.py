"""LMI_CACHE_KERNELS at start-up: a bad value, or ``native`` that cannot load, stops vLLM with one clear line."""
from __future__ import annotations

from pathlib import Path

import pytest
from e2e_support import DOCS, JobFailed, cache_env, gen_phase, prompts, run_job

from lmi_cache.transfer import kernels


def test_worker_refuses_an_unknown_kernels_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lmi_cache.transfer.layouts import ExpectedGeometry
    from lmi_cache.vllm_connector.worker_side import WorkerSide

    monkeypatch.setenv(kernels.KERNELS_ENV, "fastest")
    kernels.reset()
    try:
        side = WorkerSide(rank_index=0, geometry=ExpectedGeometry(128, 2, 32), chunk_size_tokens=256,
                          engine_factory=lambda: pytest.fail("no engine is built after a refused start"))
        whole = torch.zeros(4, 6, 2, 128, 64)
        with pytest.raises(kernels.KernelBackendError) as err:
            side.register_kv_caches({f"model.layers.{i}.self_attn.attn": whole[i] for i in range(4)})
        assert "LMI_CACHE_KERNELS='fastest'" in str(err.value) and "\n" not in str(err.value)
    finally:
        kernels.reset()


def test_vllm_start_is_refused_when_native_kernels_cannot_build(tiny_model: Path, e2e_dir: Path) -> None:
    """Real vLLM start-up with no compiler and an empty kernel cache: start fails, naming the variable."""
    env = {**cache_env(None), kernels.KERNELS_ENV: "native", "CXX": "/nonexistent/c++",
           "LMI_CACHE_KERNELS_DIR": str(e2e_dir / "empty-kernel-cache")}
    job = {"model": str(tiny_model), "connector": True, "env": env, "phases": [gen_phase("never", prompts(DOCS[:1]))]}
    with pytest.raises(JobFailed) as err:
        run_job(job, e2e_dir / "kernels-native-no-compiler")
    assert err.value.returncode != 0
    assert ("LMI_CACHE_KERNELS=native but the native kernels cannot load: no C++ compiler "
            "('/nonexistent/c++' not on PATH); install g++ and ninja, or set LMI_CACHE_KERNELS=torch") in err.value.output
