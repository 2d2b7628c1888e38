"""Crash safety of the disk tier: SIGKILL a writing process many times, then verify every load.

The writer is a torch-free subprocess (the disk tier does not need torch), so
each round costs a fraction of a second. After all rounds a fresh tier must
serve every chunk a writer reported durable, and every other chunk must load
as exactly the right bytes or be a miss.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from lmi_cache.keys.chunk_format import HEADER_BYTES
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys
from lmi_cache.metrics.warner import RateLimitedWarner
from lmi_cache.metrics.worker_series import CacheMetrics
from lmi_cache.tiers.disk.tier import DiskTier
from disk_verbs import disk_object  # noqa: E402

ROUNDS = 20
KEYS_PER_ROUND = 24
PAYLOAD_BYTES = 1024 * 1024

WRITER = textwrap.dedent("""
    import logging, os, sys, time
    import numpy as np
    from lmi_cache.keys.chunk_format import ChunkHeader
    from lmi_cache.keys.hashing import KeyNamespace, chunk_keys
    from lmi_cache.metrics.warner import RateLimitedWarner
    from lmi_cache.metrics.worker_series import CacheMetrics
    from lmi_cache.tiers.disk.tier import DiskTier
    root, first, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sys.path.insert(0, sys.argv[5])
    from disk_verbs import disk_put
    real_write = os.write

    started = []

    def slow_write(fd, data):  # a slow device with short writes: kills land mid-file
        if not started:  # the test kills at a random time after the first write, not after start-up
            started.append(True)
            print("writing", flush=True)
        time.sleep(0.001)
        return real_write(fd, memoryview(data)[:65536])

    os.write = slow_write
    tier = DiskTier([root], 1 << 30, metrics=CacheMetrics(), warner=RateLimitedWarner(logging.getLogger()),
                    num_workers=2, queue_depth=4)
    ns = KeyNamespace("crash", "uint8", "v1")
    print("ready", flush=True)
    for number in range(first, first + count):
        key = chunk_keys([number] * 16, ns, 16)[0]
        data = np.frombuffer(np.random.default_rng(number).bytes(size), dtype=np.uint8)
        while not disk_put(tier, key, ChunkHeader.for_key(key, size, "uint8", (size,)), memoryview(data)):
            tier.flush()  # queue full: wait here (the test wants every chunk attempted)
        if number % 3 == 0:
            tier.flush()
            print("durable", number, flush=True)
    tier.flush()
    print("done", flush=True)
""")


def key_of(number: int) -> ChunkKey:
    return chunk_keys([number] * 16, KeyNamespace("crash", "uint8", "v1"), 16)[0]


def expected(number: int) -> bytes:
    return np.random.default_rng(number).bytes(PAYLOAD_BYTES)


def test_sigkill_mid_write_never_yields_wrong_bytes(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    rng = random.Random(1234)
    durable: set[int] = set()
    attempted: set[int] = set()
    rounds_with_torn_tmp = 0
    for round_number in range(ROUNDS):
        first = round_number * KEYS_PER_ROUND // 2  # rounds overlap: re-stores of existing chunks too
        attempted.update(range(first, first + KEYS_PER_ROUND))
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(first), str(KEYS_PER_ROUND), str(PAYLOAD_BYTES),
             str(Path(__file__).parent)],
            stdout=subprocess.PIPE, text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        # The kill comes at a random time after the first write began (not after start-up, whose length
        # depends on the machine's load), so it lands mid-file in most rounds.
        assert child.stdout.readline().strip() == "writing"
        while round_number == ROUNDS - 1 and not durable:
            # No earlier kill came after a flush: the last round waits for one durable report (and then
            # dies mid-write as the others), so the check below has something to hold.
            report = child.stdout.readline()
            durable.update(int(m.group(1)) for m in re.finditer(r"^durable (\d+)\n", report, re.MULTILINE))
            assert report, "the writer ended without a durable report"
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        # Whole lines only: the kill may land while the child prints (a cut report claims nothing).
        durable.update(int(m.group(1)) for m in re.finditer(r"^durable (\d+)\n", output, re.MULTILINE))
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
