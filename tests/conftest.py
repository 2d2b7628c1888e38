"""The fast tier's promise, kept by pytest itself: ``pytest -m "not vllm"`` never imports vLLM (test process).

Also mypy starts in the background as soon as the session's tests are collected
(when ``tests/test_typing.py`` is selected): it takes about a minute on one
core, which the other core spends on the tests before it (fixture ``mypy_run``),
and the session's vLLM model-info folder is made before any worker starts
(``tests/vllm_cache.py``).

A test module that needs vLLM says so with a module-level ``pytestmark`` naming
``pytest.mark.vllm`` (``tests/e2e`` marks its items in its own conftest). When
the ``-m`` expression deselects such tests, their modules are not even
imported (importing vLLM alone takes seconds), and the run fails with one line
naming the first test or module after which ``vllm`` was in ``sys.modules``:
mark that module, or import vLLM inside the glue package only.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from e2e_groups import E2E_DIR, e2e_scope
from engine_starts import ENGINE_STARTS_KEY, engine_starts_line
from vllm_cache import share_modelinfos

VLLM_MODULE_MARK = re.compile(r"^pytestmark\s*=.*\bmark\.vllm\b", re.MULTILINE)


def _vllm_deselected(config: pytest.Config) -> bool:
    """Whether the -m expression drops a test marked ``vllm`` (alone, or with ``slow``)."""
    markexpr = config.getoption("markexpr", "") or ""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser
    except ImportError:  # a pytest without it: modules are imported, and the guard below still holds
        return False
    expression = Expression.compile(markexpr)
    return not any(expression.evaluate(lambda name, marks=marks, **_: name in marks)
                   for marks in ({"vllm"}, {"vllm", "slow"}))


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_GUARD] = _vllm_deselected(config) and "vllm" not in sys.modules
    # Before pytest-xdist starts its workers: they and the vLLM processes they start inherit the folder.
    config.stash[_MODELINFOS] = share_modelinfos()
    _share_the_cores()


def _share_the_cores() -> None:
    """Under pytest-xdist, a worker's own torch work uses its share of the cores, not all of them.

    torch's OpenMP pool has one thread per core in every worker; three workers on two cores then spin against
    each other (a 37 s blend test took 170 s beside two vLLM jobs). vLLM processes the workers start set their
    own threads; this is the worker's in-process torch only.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        return
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


_GUARD = pytest.StashKey[bool]()
_MODELINFOS = pytest.StashKey["Path | None"]()
_REPORTED = pytest.StashKey[bool]()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not config.stash.get(_GUARD, False):
        return None
    if collection_path == E2E_DIR:
        return True
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if VLLM_MODULE_MARK.search(collection_path.read_text(encoding="utf-8", errors="replace")):
            return True
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    config = item.config
    if call.when != "teardown" or not _newly_imported(config):
        return
    report = outcome.get_result()
    report.outcome = "failed"
    report.longrepr = (f"vllm was imported under -m 'not vllm' by {item.nodeid}: mark that test (or its module) "
                       "with pytest.mark.vllm, or keep its vLLM imports in lmi_cache.vllm_connector")


def _newly_imported(config: pytest.Config) -> bool:
    """True the first time vLLM is found imported in a guarded run."""
    if not config.stash.get(_GUARD, False) or "vllm" not in sys.modules or config.stash.get(_REPORTED, False):
        return False
    config.stash[_REPORTED] = True
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, None, None]:
    outcome = yield
    if _newly_imported(collector.config):
        report = outcome.get_result()
        report.outcome = "failed"
        report.longrepr = (f"vllm was imported under -m 'not vllm' while collecting {collector.nodeid}: give that "
                           "test module `pytestmark = pytest.mark.vllm`, or keep its vLLM imports in "
                           "lmi_cache.vllm_connector")


REPO = Path(__file__).resolve().parents[1]
TYPING_TEST = Path(__file__).resolve().with_name("test_typing.py")
_MYPY = pytest.StashKey[tuple[subprocess.Popen[str], Path]]()


def _start_mypy() -> tuple[subprocess.Popen[str], Path]:
    """mypy over both packages, its output in files (a full pipe would stall it until the test reads)."""
    work = Path(tempfile.mkdtemp(prefix="lmi-cache-mypy-"))
    with open(work / "out.txt", "w") as out, open(work / "err.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mypy", "--cache-dir", str(work / "cache"),
                                 "lmi_cache", "autoconfig"], cwd=REPO, stdout=out, stderr=err, text=True)
    return proc, work


def pytest_collection_finish(session: pytest.Session) -> None:
    # Under pytest-xdist every worker collects every test: mypy then starts in the one that runs it (fixture).
    if any(item.path == TYPING_TEST for item in session.items) and not os.environ.get("PYTEST_XDIST_WORKER"):
        session.config.stash[_MYPY] = _start_mypy()


_WORKER_ENGINE_STARTS = pytest.StashKey[dict[str, int]]()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (controller process), under ``-n``
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each e2e group in one worker, every other test spread over the workers one by one.

    A group's shared vLLM jobs, job slots and engine-start count belong to its worker. With ``-n 3`` (the
    README's command) two workers start on the two groups, the largest scopes, and the third runs the
    fast tier, then all three share what is left. (xdist's own ``loadgroup`` marks do not group under
    pytest 9.2, which no longer reads the node id that xdist rewrites.)
    """
    from xdist.scheduler import LoadScopeScheduling

    class E2eGroups(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return e2e_scope(nodeid) or nodeid

    return E2eGroups(config, log)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a worker finished (controller process)
def pytest_testnodedown(node: Any, error: object) -> None:
    starts = getattr(node, "workeroutput", {}).get(ENGINE_STARTS_KEY)
    if starts:
        total = node.config.stash.setdefault(_WORKER_ENGINE_STARTS, {})
        for name, count in starts.items():
            total[name] = total.get(name, 0) + count


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    starts = terminalreporter.config.stash.get(_WORKER_ENGINE_STARTS, None)
    if starts:
        terminalreporter.write_line(engine_starts_line(starts))


def pytest_unconfigure(config: pytest.Config) -> None:
    owned = config.stash.get(_MODELINFOS, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)
    started = config.stash.get(_MYPY, None)
    if started is not None:
        proc, work = started
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def mypy_run(request: pytest.FixtureRequest) -> subprocess.CompletedProcess[str]:
    """mypy over both packages: the run started at collection, or one started now."""
    if _MYPY not in request.config.stash:
        request.config.stash[_MYPY] = _start_mypy()
    proc, work = request.config.stash[_MYPY]
    proc.wait(timeout=600)
    out, err = ((work / name).read_text() for name in ("out.txt", "err.txt"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
