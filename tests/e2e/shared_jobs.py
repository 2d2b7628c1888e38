"""vLLM jobs shared between e2e modules, and how many vLLM processes run at once (test process).

Each vLLM start costs tens of seconds, most of it on one core (imports, model
load, profiling); the tier's time is mostly starts. Two levers:

- **One start, many readers.** A :class:`SharedJob` is one ``run_llm.py``
  process for a configuration (model, connector, vLLM arguments, env). Each
  module adds its phases at import time with :meth:`SharedJob.add` and reads
  them back through the session's :class:`SharedJobs` (fixture
  ``shared_jobs``). Only jobs whose phases leave no state behind for the
  next reader are shared between modules: no connector, and vLLM's own prefix
  cache emptied before each module's first phase (``reset_prefix_cache``), so
  each module's phases see what a fresh process would show them. A job with
  the connector keeps one owner (its tiers carry over from phase to phase).
- **A slot each.** Every vLLM job started through ``e2e_support.run_job``
  (or inside ``e2e_support.job_slot``) holds a slot; ``LMI_CACHE_E2E_JOBS``
  slots exist (default 2 alone, 1 in each of the two e2e workers under
  pytest-xdist, whose groups already fill two cores: ``tests/conftest.py``).
  A job that binds every core itself (tensor or data parallel) holds all of
  them. Shared jobs start in the background as soon as the session's first
  e2e test runs, so they overlap with the modules before their readers.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from e2e_support import DOCS, PARTIAL, PREEMPT, PREEMPT_MAX_TOKENS, SALTED, cache_env, gen_phase, prompts

@dataclass
class SharedJob:
    """One vLLM process whose phases several test modules read.

    ``configure(e2e_dir)`` makes the model and returns the ``run_llm.py`` job without its phases
    (``model``, ``connector``, ``llm_kwargs``, ``env``); ``connector`` says whether it runs the
    connector. ``readers`` names fixtures that read the job for other modules (``baseline``): a
    selected test that uses one, or a selected test of an owner module, starts the job in the background.
    """

    name: str
    configure: Callable[[Path], dict[str, Any]]
    connector: bool
    readers: tuple[str, ...] = ()
    owners: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, owner: str, phases: list[dict[str, Any]]) -> None:
        """Register ``owner``'s phases (call at import time: the job starts once, with every owner's phases)."""
        if self.connector and self.owners and owner not in self.owners:
            raise ValueError(f"{self.name}: a job with the connector keeps one owner ({next(iter(self.owners))})")
        self.owners.setdefault(owner, []).extend(phases)

    def full_job(self, e2e_dir: Path) -> dict[str, Any]:
        phases = []
        for owner, own in self.owners.items():
            for i, item in enumerate(own):
                before = list(item.get("before", []))
                if i == 0 and not self.connector:
                    before.insert(0, "reset_prefix_cache")  # each owner's phases start from an empty cache
                phases.append({**item, "name": f"{owner}:{item['name']}", "before": before})
        return {**self.configure(e2e_dir), "phases": phases}


def owner_view(result: dict[str, Any], owner: str) -> dict[str, Any]:
    """A job's result with only ``owner``'s phases, under the names the owner gave them."""
    prefix = f"{owner}:"
    mine = [{**p, "name": p["name"][len(prefix):]} for p in result["phases"] if p["name"].startswith(prefix)]
    return {**result, "phases": mine}


class SharedJobs:
    """The session's shared jobs: started in the background, read by each owner's module fixtures."""

    def __init__(self, e2e_dir: Path, jobs: list[SharedJob], run: Callable[[dict[str, Any], Path], dict[str, Any]]):
        self._e2e_dir = e2e_dir
        self._run = run
        self._pool = ThreadPoolExecutor(max(1, len(jobs)), thread_name_prefix="shared-job")
        self._futures: dict[str, Future[dict[str, Any]]] = {}
        self._jobs = {job.name: job for job in jobs}
        self._lock = threading.Lock()

    def start(self, names: list[str]) -> None:
        for name in names:
            self._future(name)

    def _future(self, name: str) -> Future[dict[str, Any]]:
        with self._lock:
            if name not in self._futures:
                # The job (and its model) is made here, in the caller's thread: a tiny model's weights come
                # from torch's process-wide RNG, so two made at once in two threads would mix their draws.
                full = self._jobs[name].full_job(self._e2e_dir)
                self._futures[name] = self._pool.submit(self._run, full, self._e2e_dir / name)
            return self._futures[name]

    def result(self, job: SharedJob, owner: str) -> dict[str, Any]:
        """``owner``'s phases of ``job`` (starting it now if it has not started)."""
        if owner not in job.owners:
            raise KeyError(f"{owner} added no phases to {job.name}")
        return owner_view(self._future(job.name).result(), owner)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def jobs_used_by(items: list[pytest.Item], jobs: list[SharedJob]) -> list[str]:
    """Shared jobs that a selected test reads: it is in an owner module or uses one of the job's readers."""
    tests = [item for item in items if isinstance(item, pytest.Function)]
    modules = {getattr(item.module, "__name__", "") for item in tests}
    fixtures = {name for item in tests for name in item.fixturenames}
    return [job.name for job in jobs if modules & set(job.owners) or fixtures & set(job.readers)]


# The shared configurations. To read one from a new module: add your phases at import time,
# ``TINY_REFERENCE.add(__name__, [gen_phase(...), ...])``, and in a module fixture
# ``shared_jobs.result(TINY_REFERENCE, __name__)`` gives your phases under the names you gave them.
# A new configuration that two modules read: a SharedJob here, appended to SHARED.

def tiny_model_dir(e2e_dir: Path) -> Path:
    """The suite's 7M Llama (``LMI_CACHE_TEST_MODEL_DIR`` reuses a folder across sessions)."""
    from lmi_cache.devtools.tiny_model import make_tiny_model

    cached = os.environ.get("LMI_CACHE_TEST_MODEL_DIR")
    return make_tiny_model(Path(cached) if cached else e2e_dir / "tiny-7m", "7m", seed=0)


def gemma2_model_dir(e2e_dir: Path) -> Path:
    """The Gemma-2-shaped sliding-window model: a windowed and a full-attention KV cache group."""
    from lmi_cache.devtools.tiny_model import make_tiny_model

    return make_tiny_model(e2e_dir / "tiny-gemma2-7m", "gemma2-7m", seed=0)


def _reference(model: Callable[[Path], Path]) -> Callable[[Path], dict[str, Any]]:
    """vLLM without a connector, its own prefix cache on: a warm phase's exact reference."""
    return lambda e2e_dir: {"model": str(model(e2e_dir)), "connector": False,
                            "llm_kwargs": {"enable_prefix_caching": True}}


def _first_connector_job(e2e_dir: Path) -> dict[str, Any]:
    disk = e2e_dir / "disk-tier"
    disk.mkdir(exist_ok=True)
    return {"model": str(tiny_model_dir(e2e_dir)), "connector": True, "disk_dir": str(disk), "env": cache_env(disk)}


TINY_REFERENCE = SharedJob("baseline", _reference(tiny_model_dir), connector=False, readers=("baseline",))
GEMMA2_REFERENCE = SharedJob("reference-gemma2-7m", _reference(gemma2_model_dir), connector=False)
# The first connector process (CPU + disk tiers): the disk-restart job reuses the disk tier it fills.
TINY_CONNECTOR = SharedJob("connector", _first_connector_job, connector=True, readers=("connector_run",))
SHARED = [TINY_REFERENCE, GEMMA2_REFERENCE, TINY_CONNECTOR]

# ``docs`` is a cold prefill; ``docs_again`` hits vLLM's own prefix cache at the same token the
# connector loads up to, so it is the exact reference of a warm run (vLLM's CPU attention is
# float32-deterministic for a given split and batch, but not across different splits).
TINY_REFERENCE.add("conftest", [
    gen_phase("docs", prompts(DOCS)),
    gen_phase("docs_again", prompts(DOCS)),
    gen_phase("partial", prompts(PARTIAL)),
    gen_phase("salted", prompts([SALTED])),
    gen_phase("preempt", prompts(PREEMPT), max_tokens=PREEMPT_MAX_TOKENS),
])
TINY_CONNECTOR.add("conftest", [
    gen_phase("cold", prompts(DOCS)),
    gen_phase("warm", prompts(DOCS)),
    gen_phase("partial", prompts(PARTIAL)),
    gen_phase("salt_a", prompts([SALTED], salt="tenant-a")),
    gen_phase("salt_b", prompts([SALTED], salt="tenant-b")),
    gen_phase("salt_a_again", prompts([SALTED], salt="tenant-a")),
])
