"""Where the peer tier's native threads run: off the core vLLM binds the worker's main thread to (any process).

vLLM's CPU backend binds the worker's main thread to the core of its OpenMP
master, and a thread inherits the affinity of the thread that starts it,
native threads included: ZMQ's I/O thread (started with a context's first
socket) and the transfer engine's threads. Started from the main thread they
share that core with the OpenMP threads, and on a busy host a peer's message
then waits there for seconds (measured: lookups between two servers on one
2-core host missed a 2 s bound about half the time, and arrived in
milliseconds once started from an unpinned thread). So both are started here,
on a short-lived thread that first widens its affinity
(``thread_affinity.unpin_current_thread``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import zmq

from lmi_cache.thread_affinity import unpin_current_thread

T = TypeVar("T")
_context: zmq.Context[zmq.Socket[bytes]] | None = None
_context_lock = threading.Lock()


def run_unpinned(build: Callable[[], T]) -> T:
    """``build()`` on a thread with the container's CPUs; what it raises is raised here."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        unpin_current_thread()
        try:
            result.append(build())
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)

    thread = threading.Thread(target=run, name="lmi-peer-start")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def peer_context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process's ZMQ context for peer messages, its I/O thread started unpinned."""
    global _context
    with _context_lock:
        if _context is None:
            _context = run_unpinned(_started_context)
        return _context


def _started_context() -> zmq.Context[zmq.Socket[bytes]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    context.socket(zmq.REQ).close(linger=0)  # the first socket starts the I/O thread, here
    return context
