"""A ``VLLM_CACHE_ROOT`` for each vLLM the tests start, all sharing one model-info cache (test process).

Before vLLM builds an engine it inspects the model's class (multimodal? pooling? ...), and it does so in a
new Python interpreter that imports vLLM: several seconds of one core, unless ``VLLM_CACHE_ROOT/modelinfos``
already holds the answer (one JSON file per class, keyed by a hash of the class's source file, written
atomically). Each job and server keeps a cache root of its own (no job reads another's compiled graphs),
but its ``modelinfos`` folder is a link to one folder per test session, so each model class is inspected
once per session instead of once per vLLM start.

The session's first process (the pytest-xdist controller, or pytest alone) makes that folder and names it
in ``LMI_CACHE_TEST_MODELINFOS``, which the workers and every process they start inherit.

``LEAN_VLLM_ENV`` is what else every vLLM the tests start runs with (see its comment).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

MODELINFOS_ENV = "LMI_CACHE_TEST_MODELINFOS"

# What every vLLM job and one-rank server of the tests runs with: the model in the engine core's process, as
# vLLM runs TP=1 on a GPU. vLLM's CPU backend would otherwise start one more spawned interpreter for it (to
# bind its OpenMP threads), which imports vLLM again: about 15 s of one core per start. A server's API process
# and engine core stay separate processes; tensor-parallel jobs keep a worker per rank, and the data-parallel
# server runs vLLM's default. (One OpenMP thread per process would save more CPU, but it changes float32
# rounding between two jobs of the speculative module: their logprobs, compared exactly, differed.)
LEAN_VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def share_modelinfos() -> Path | None:
    """Make the session's model-info folder and name it in the environment; None if a parent process did."""
    if os.environ.get(MODELINFOS_ENV):
        return None
    path = Path(tempfile.mkdtemp(prefix="lmi-cache-modelinfos-"))
    os.environ[MODELINFOS_ENV] = str(path)
    return path


def vllm_cache_root(work_dir: Path) -> str:
    """``work_dir/vllm-cache`` (made here), its ``modelinfos`` linked to the session's folder when there is one."""
    root = work_dir / "vllm-cache"
    root.mkdir(parents=True, exist_ok=True)
    shared = os.environ.get(MODELINFOS_ENV)
    link = root / "modelinfos"
    if shared and not link.is_symlink() and not link.exists():
        link.symlink_to(shared, target_is_directory=True)
    return str(root)
