"""serve as the server's parent: signals forwarded, statuses passed on, an unasked exit 0 is a failure."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from autoconfig.serve.supervise import UNASKED_EXIT_STATUS, exit_status

REPO = Path(__file__).resolve().parents[2]

# A stand-in server: reports ready, then does what argv[1] says.
SERVER = textwrap.dedent("""
    import os, signal, sys, time
    what = sys.argv[1]
    def on_term(signum, frame):
        print("got", signum, flush=True)
        sys.exit(0)  # a clean drain
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    if what == "exit0":
        sys.exit(0)
    if what == "exit3":
        sys.exit(3)
    if what == "orphan":  # a grandchild outlives its parent and ends while the server runs
        pid = os.fork()
        if pid == 0:
            if os.fork() == 0:
                time.sleep(0.3)
                os._exit(0)
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(1.0)
        print("orphan ended", flush=True)
    time.sleep(60)
""")

# serve's part, as run_launch runs it: the stand-in's argv and a line of output per event.
SUPERVISOR = textwrap.dedent("""
    import ctypes, sys
    from autoconfig.serve.supervise import run_supervised
    if sys.argv[2] == "orphan":  # orphans re-parent to this process, as to PID 1 in a container
        assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    status = run_supervised([sys.executable, "-c", sys.argv[1], sys.argv[2]], dict(__import__("os").environ),
                            lambda line: print(line, file=sys.stderr, flush=True))
    print("status", status, flush=True)
    sys.exit(status)
""")


def _start(what: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, SERVER, what], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _descendants(pid: int) -> list[int]:
    """The pids under ``pid``; none when it has just exited."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_state(pid: int) -> str:
    """State and signal masks of ``pid`` and its children (from /proc), for a failure message."""
    lines = []
    for each in [pid, *_descendants(pid)]:
        try:
            status = Path(f"/proc/{each}/status").read_text().splitlines()
        except OSError:
            continue
        fields = [line for line in status if line.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn",
                                                                 "SigCgt"))]
        lines.append(f"pid {each}: " + "; ".join(fields))
    return "\n".join(lines)


def _finish(proc: subprocess.Popen[str], timeout_s: float = 30) -> tuple[str, str]:
    """``proc.communicate``; on a timeout, a failure naming each process's state and signal masks (a hang
    seen once under load, not understood yet: this says where the signal stopped)."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        state = _signal_state(proc.pid)
        for child in _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"serve still running {timeout_s} s later:\n{state}\nstdout: {out!r}\nstderr: {err[-2000:]!r}")


def test_a_server_that_stops_on_its_own_with_status_0_fails_the_container() -> None:
    proc = _start("exit0")
    out, err = _finish(proc)
    assert proc.returncode == UNASKED_EXIT_STATUS
    assert out.strip() == f"status {UNASKED_EXIT_STATUS}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmi-cache serve: error: the server stopped on its own")


def test_sigterm_is_forwarded_and_a_clean_drain_is_success() -> None:
    proc = _start("serve")
    proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc)
    assert out.split("\n")[:2] == [f"got {int(signal.SIGTERM)}", "status 0"]
    assert proc.returncode == 0 and err == ""


def test_sigint_is_forwarded_and_a_server_it_kills_exits_130() -> None:
    # The stand-in drains on SIGTERM only: SIGINT ends it through KeyboardInterrupt, which Python
    # finishes by dying of SIGINT itself, so serve reports 128 + 2 as a shell would.
    proc = _start("serve")
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc)
    assert proc.returncode == 128 + signal.SIGINT and "KeyboardInterrupt" in err and "on its own" not in err


def test_a_server_killed_by_a_signal_exits_128_plus_it() -> None:
    proc = _start("serve")
    children = psutil.Process(proc.pid).children()
    assert len(children) == 1
    children[0].kill()
    out, _ = _finish(proc)
    assert proc.returncode == 128 + signal.SIGKILL and out.strip() == f"status {128 + signal.SIGKILL}"


def test_a_non_zero_exit_passes_through() -> None:
    proc = _start("exit3")
    out, err = _finish(proc)
    assert proc.returncode == 3 and out.strip() == "status 3" and err == ""


def _zombie_children(pid: int) -> list[str]:
    zombies = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(pid) and fields[0] == "Z":
            zombies.append(entry.name)
    return zombies


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER and /proc")
def test_orphans_that_end_while_the_server_runs_are_reaped() -> None:
    proc = _start("orphan")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "orphan ended"
    assert _zombie_children(proc.pid) == []
    proc.send_signal(signal.SIGTERM)
    out, _ = _finish(proc)
    assert proc.returncode == 0


def test_exit_status_mapping() -> None:
    assert exit_status(0, stop_requested=True) == (0, None)
    assert exit_status(0, stop_requested=False)[0] == UNASKED_EXIT_STATUS
    assert exit_status(5 << 8, stop_requested=False) == (5, None)
    assert exit_status(signal.SIGTERM, stop_requested=True) == (128 + signal.SIGTERM, None)  # killed, not exited


def test_a_signal_before_the_server_started_still_reaches_it() -> None:
    from autoconfig.serve import supervise

    forwarder = supervise._Forwarder()
    forwarder(signal.SIGTERM, None)
    assert forwarder.stop_requested and forwarder.pending == [signal.SIGTERM]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        forwarder.started(sleeper.pid)
        assert sleeper.wait(timeout=30) == -signal.SIGTERM and forwarder.pending == []
    finally:
        sleeper.kill()
