"""Crash safety of the disk tier: SIGKILL a writing process many times, then verify every load.

Each round's writer is forked from one helper process that imported the disk
tier once (importing it takes about 1.5 s, torch included: twenty new
interpreters spent most of the test's time starting). The helper is a fresh
interpreter that runs nothing but forks, so each writer starts clean; it is
still a process of its own that dies by SIGKILL mid-file. After all rounds a
fresh tier must serve every chunk a writer reported durable, and every other
chunk must load as exactly the right bytes or be a miss.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from lmi_cache.keys.chunk_format import HEADER_BYTES, ChunkHeader
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.tiers.disk.tier import DiskTier
from disk_verbs import disk_object, disk_put  # noqa: E402

ROUNDS = 20
KEYS_PER_ROUND = 24
PAYLOAD_BYTES = 1024 * 1024


def key_of(number: int) -> ChunkKey:
    return chunk_keys([number] * 16, KeyNamespace("crash", "uint8", "v1"), 16)[0]


def expected(number: int) -> bytes:
    return np.random.default_rng(number).bytes(PAYLOAD_BYTES)


def _write(root: str, first: int, count: int, report_path: str) -> None:
    """The writer (a forked child): ``count`` chunks through a slow device, reporting one line each to
    ``report_path``: "writing" at its first write, "durable N" after each flush. SIGKILL may cut the last."""
    reports = open(report_path, "a", buffering=1)
    real_write = os.write
    started: list[bool] = []

    def slow_write(fd: int, data: bytes) -> int:  # a slow device with short writes: kills land mid-file
        if not started:  # the test kills at a random time after the first write, not after start-up
            started.append(True)
            reports.write("writing\n")
        time.sleep(0.001)
        return real_write(fd, memoryview(data)[:65536])

    os.write = slow_write  # type: ignore[assignment]
    tier = DiskTier([root], 1 << 30, metrics=CacheMetrics(), warner=RateLimitedWarner(logging.getLogger()),
                    num_workers=2, queue_depth=4)
    for number in range(first, first + count):
        key = key_of(number)
        data = np.frombuffer(expected(number), dtype=np.uint8)
        while not disk_put(tier, key, ChunkHeader.for_key(key, PAYLOAD_BYTES, "uint8", (PAYLOAD_BYTES,)), data):
            tier.flush()  # queue full: wait here (the test wants every chunk attempted)
        if number % 3 == 0:
            tier.flush()
            reports.write(f"durable {number}\n")
    tier.flush()
    reports.write("done\n")


def _fork_writers(orders: Connection) -> None:
    """The helper: for each order, fork a writer, send its pid, reap it, send its end."""
    while (order := orders.recv()) is not None:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _write(*order)
            except BaseException:  # said in the report file, which the test shows when it waits in vain
                with open(order[-1], "a") as report:
                    traceback.print_exc(file=report)
                code = 1
            os._exit(code)
        orders.send(pid)
        _, status = os.waitpid(pid, 0)
        orders.send(status)


@contextmanager
def writer_host() -> Iterator[Connection]:
    """The helper process (a new interpreter: the test process's threads are not forked) and its order line."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    helper = context.Process(target=_fork_writers, args=(theirs,), daemon=True)
    helper.start()
    try:
        yield ours
    finally:
        ours.send(None)
        helper.join(30)


def _reports(path: Path) -> list[str]:
    """Whole report lines only: a line the kill cut claims nothing."""
    return re.findall(r"^(.*)\n", path.read_text(), re.MULTILINE) if path.exists() else []


def _wait_for(path: Path, found: Callable[[list[str]], bool], what: str) -> None:
    deadline = time.monotonic() + 120
    while not found(_reports(path)):
        if time.monotonic() > deadline:
            said = path.read_text()[-3000:] if path.exists() else "(no report file)"
            raise AssertionError(f"the writer never reported {what}:\n{said}")
        time.sleep(0.001)


def test_sigkill_mid_write_never_yields_wrong_bytes(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    rng = random.Random(1234)
    durable: set[int] = set()
    attempted: set[int] = set()
    rounds_with_torn_tmp = 0
    with writer_host() as host:
        for round_number in range(ROUNDS):
            first = round_number * KEYS_PER_ROUND // 2  # rounds overlap: re-stores of existing chunks too
            attempted.update(range(first, first + KEYS_PER_ROUND))
            report_path = tmp_path / f"round-{round_number}.txt"
            host.send((str(root), first, KEYS_PER_ROUND, str(report_path)))
            pid = host.recv()
            # The kill comes at a random time after the first write began (not after start-up, whose length
            # depends on the machine's load), so it lands mid-file in most rounds.
            _wait_for(report_path, lambda lines: "writing" in lines, "its first write")
            if round_number == ROUNDS - 1 and not durable:
                # No earlier kill came after a flush: the last round waits for one durable report (and then
                # dies mid-write as the others), so the check below has something to hold.
                _wait_for(report_path, lambda lines: any(ln.startswith("durable ") for ln in lines) or "done" in lines,
                          "a durable chunk")
            time.sleep(rng.uniform(0.0, 0.08))
            os.kill(pid, signal.SIGKILL)
            status = host.recv()  # the helper reaped it: killed, or (rarely) done before the kill, never failed
            assert os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) == 0, _reports(report_path)
            durable.update(int(line.split()[1]) for line in _reports(report_path) if line.startswith("durable "))
            rounds_with_torn_tmp += any(root.rglob("*.tmp"))

    tier = DiskTier([str(root)], 1 << 30, metrics=CacheMetrics(), warner=RateLimitedWarner(logging.getLogger()))
    try:
        assert not list(root.rglob("*.tmp")), "start-up must remove torn temporary files"
        hits = 0
        for number in sorted(attempted):
            obj = disk_object(tier, key_of(number))
            if obj is None:
                assert number not in durable, f"chunk {number} was reported durable but is gone"
                continue
            assert bytes(obj[HEADER_BYTES : HEADER_BYTES + PAYLOAD_BYTES]) == expected(number), number
            hits += 1
        assert durable and hits >= len(durable)
        assert tier._metrics.snapshot().get("disk_corrupted_reads", 0) == 0  # rename is atomic
    finally:
        tier.close()
        shutil.rmtree(root, ignore_errors=True)
    # The kills must really land mid-write sometimes, or this test proves nothing.
    assert rounds_with_torn_tmp >= 5
