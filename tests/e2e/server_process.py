"""Start an HTTP server subprocess (lmi-cache serve or vLLM) for e2e tests, wait until it answers, stop it.

The server runs in its own session so that stopping it also stops vLLM's
engine and worker processes; its output goes to a log whose tail is shown
when it fails to start (test process).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

READY_TIMEOUT_S = 300  # ~20 s on an idle 2-core machine; the shared CI machine can be much slower


def get_status(url: str) -> int:
    """HTTP status of a GET, 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def log_tail(log_path: Path, num_chars: int = 4000) -> str:
    return log_path.read_text(errors="replace")[-num_chars:]


def _stop(proc: subprocess.Popen[bytes], whole_group: bool) -> None:
    if proc.poll() is not None:
        return
    if whole_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)  # serve forwards it; its exit code is part of some tests
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: vLLM's engine and workers
        proc.wait(timeout=30)


@contextmanager
def running_server(
    cmd: list[str],
    *,
    env: dict[str, str],
    log_path: Path,
    ready_url: str,
    cwd: Path | None = None,
    sigterm_whole_group: bool = False,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` until the block ends; fail the test if ``ready_url`` does not answer 200 in time."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    try:
        started = time.monotonic()
        while get_status(ready_url) != 200:
            if proc.poll() is not None:
                pytest.fail(f"{cmd[0]} exited with {proc.returncode} before {ready_url} was ready:\n{log_tail(log_path)}")
            if time.monotonic() - started > ready_timeout_s:
                pytest.fail(f"{ready_url} not 200 after {ready_timeout_s} s:\n{log_tail(log_path)}")
            time.sleep(1)
        print(f"server ready in {time.monotonic() - started:.1f} s")
        yield proc
    finally:
        _stop(proc, sigterm_whole_group)


def resend_until_cached(send: Callable[[], dict[str, Any]], attempts: int = 5) -> tuple[dict[str, Any], int]:
    """Send the same completion again until part of its prompt comes from a cache: (reply, cached tokens).

    The store of the first request may land just after its answer, so the first repeat can still miss.
    """
    for attempt in range(attempts):
        reply = send()
        cached = int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        if cached or attempt == attempts - 1:
            return reply, cached
        time.sleep(0.5)
    raise ValueError("attempts must be positive")
