"""Run the server as ``lmi-cache serve``'s child, so that a server that dies is seen to fail.

serve used to replace itself with vLLM (``exec``). vLLM's OpenAI server,
though, ends *normally* when its engine dies: its watchdog sees the engine
errored and tells uvicorn to exit, and the process exits with status 0. A
container whose server stopped on its own then reports success, and
restart-on-failure policies (ECS, Kubernetes ``OnFailure``, systemd
``Restart=on-failure``) leave it down.

So serve stays as the parent: it forwards the signals a container runtime or
a terminal sends, waits for the server, and turns its end into the
container's exit status:

* stopped by a signal serve was sent (SIGTERM from ``docker stop``, SIGINT...):
  the server's own status (0 after a clean drain);
* ended by a signal itself: 128 + the signal number, as a shell reports it;
* exited non-zero: that status;
* exited 0 without having been asked to stop: one error line and status 1.

As PID 1 of a container serve also reaps orphans the server leaves (its
engine and worker processes re-parent to PID 1 when the server dies first).
"""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

# What a container runtime, a terminal or an operator sends; all reach the server.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Of those, the ones that ask the server to stop: after one, a clean exit 0 is a clean stop.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
UNASKED_EXIT_STATUS = 1
UNASKED_EXIT_LINE = ("lmi-cache serve: error: the server stopped on its own with exit status 0 (vLLM does this "
                     "when its engine dies; its log above says why); exiting {status} so the container is seen "
                     "to fail")


class _Forwarder:
    """Signal handler state: the child (once started) and whether a stop was asked for."""

    def __init__(self) -> None:
        self.child_pid: int | None = None
        self.stop_requested = False
        self.pending: list[int] = []  # signals that arrived before the child existed

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if signum in STOP_SIGNALS:
            self.stop_requested = True
        if self.child_pid is None:
            self.pending.append(signum)
            return
        _send(self.child_pid, signum)

    def started(self, pid: int) -> None:
        self.child_pid = pid
        for signum in self.pending:
            _send(pid, signum)
        self.pending.clear()


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it has just exited; the wait below sees that


def _wait_for(pid: int) -> int:
    """The wait status of ``pid``; every other child that ends meanwhile (an orphan, as PID 1) is reaped."""
    while True:
        done, status = os.waitpid(-1, 0)  # retried by Python after each signal handler (PEP 475)
        if done == pid:
            return status


def exit_status(wait_status: int, stop_requested: bool) -> tuple[int, str | None]:
    """The container's exit status for the server's wait status, and the line to print (or None)."""
    code = os.waitstatus_to_exitcode(wait_status)
    if code < 0:
        return 128 - code, None
    if code == 0 and not stop_requested:
        return UNASKED_EXIT_STATUS, UNASKED_EXIT_LINE.format(status=UNASKED_EXIT_STATUS)
    return code, None


def run_supervised(argv: Sequence[str], env: Mapping[str, str], echo: Callable[[str], None]) -> int:
    """Start ``argv`` with ``env``, forward signals to it, and return the exit status (see the module docstring)."""
    forwarder = _Forwarder()
    previous = {signum: signal.signal(signum, forwarder) for signum in FORWARDED_SIGNALS}
    try:
        # Same process group and session: a terminal's Ctrl-C or a group kill reaches the server
        # directly too (vLLM's shutdown handler ignores a second request).
        child = subprocess.Popen(list(argv), env=dict(env))
        forwarder.started(child.pid)
        wait_status = _wait_for(child.pid)
        child.returncode = os.waitstatus_to_exitcode(wait_status)  # reaped here, not by Popen
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    status, line = exit_status(wait_status, forwarder.stop_requested)
    if line is not None:
        echo(line)
    return status
