"""The blend keeps its large host temporaries in glibc's heap (mallopt), and says so when it cannot."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from lmi_cache.blend import host_heap
from lmi_cache.blend.host_heap import (
    HEAP_MMAP_THRESHOLD_BYTES,
    HEAP_TRIM_THRESHOLD_BYTES,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    keep_large_allocations_in_heap,
    wanted_thresholds,
)


def test_the_environment_may_only_raise_the_thresholds() -> None:
    assert wanted_thresholds({}) == {M_MMAP_THRESHOLD: HEAP_MMAP_THRESHOLD_BYTES,
                                     M_TRIM_THRESHOLD: HEAP_TRIM_THRESHOLD_BYTES}
    lower = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
    assert wanted_thresholds(lower) == wanted_thresholds({})  # serve's remote-tier values stay below ours
    higher = {"MALLOC_MMAP_THRESHOLD_": str(3 << 30), "MALLOC_TRIM_THRESHOLD_": "nonsense"}
    assert wanted_thresholds(higher) == {M_MMAP_THRESHOLD: 3 << 30, M_TRIM_THRESHOLD: HEAP_TRIM_THRESHOLD_BYTES}


# Bytes glibc holds in mmapped blocks before and after a 96 MiB tensor is allocated and freed
# twice: a fresh mapping per allocation without the thresholds, heap memory with them.
_PROBE = textwrap.dedent("""
    import ctypes, sys, torch
    from lmi_cache.blend.host_heap import keep_large_allocations_in_heap

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "on":
        assert keep_large_allocations_in_heap()
    for _ in range(2):
        big = torch.empty(24 << 20, dtype=torch.float32)  # 96 MiB
        mapped = libc.mallinfo2().hblkhd
        del big
    print(mapped >= 96 << 20)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
@pytest.mark.parametrize("mode, mapped", [("off", "True"), ("on", "False")])
def test_large_allocations_come_from_the_heap_once_set(mode: str, mapped: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == mapped


def test_without_glibc_or_when_refused_it_is_one_log_line(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=host_heap.__name__)
    monkeypatch.setattr(host_heap, "_glibc_mallopt", lambda: None)
    assert keep_large_allocations_in_heap({}) is False
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(host_heap, "_glibc_mallopt", lambda: lambda param, value: calls.append((param, value)) or 0)
    assert keep_large_allocations_in_heap({}) is False
    assert calls and all(value <= 2**31 - 1 for _, value in calls)  # a C int each
    lines = [r.getMessage() for r in caplog.records if r.name == host_heap.__name__]
    assert len(lines) == 2 and "not glibc" in lines[0] and "refused" in lines[1]


# Page faults of touching a 200 MiB tensor after 512 MiB of heap was prewarmed (or not).
_PREWARM_PROBE = textwrap.dedent("""
    import resource, sys, torch
    from lmi_cache.blend.host_heap import keep_large_allocations_in_heap, prewarm_heap

    assert keep_large_allocations_in_heap()
    if sys.argv[1] == "on":
        assert prewarm_heap(512 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.zeros(50 << 20, dtype=torch.float32)  # 200 MiB: 51,200 pages
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_prewarmed_heap_serves_a_large_block_without_faulting_it_in() -> None:
    faults = {}
    for mode in ("off", "on"):
        proc = subprocess.run([sys.executable, "-c", _PREWARM_PROBE, mode], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        faults[mode] = int(proc.stdout.strip().splitlines()[-1])
    assert faults["off"] > 40_000  # every page fresh (transparent huge pages would cut this: not on by default)
    assert faults["on"] < 2_000


def test_prewarm_sizes_from_the_model_and_refuses_what_would_be_mmapped() -> None:
    # The RAG benchmark's 8-layer model: 4 KV heads x 64, 8,143 tokens -> 16 x 67 MB, capped at 960 MiB.
    assert host_heap.blend_heap_bytes(8, 4, 64, 8143) == host_heap.PREWARM_MAX_BYTES
    assert host_heap.blend_heap_bytes(4, 2, 32, 512) == host_heap.PREWARM_MIN_BYTES  # 4 MiB wanted: the floor
    assert host_heap.blend_heap_bytes(8, 4, 64, 2048) == 16 * 8 * 4 * 64 * 4 * 2048  # 256 MiB: in between
    assert host_heap.PREWARM_MAX_BYTES < HEAP_MMAP_THRESHOLD_BYTES
    assert host_heap.prewarm_heap(HEAP_MMAP_THRESHOLD_BYTES) is False  # glibc would mmap it: nothing to keep
    assert host_heap.prewarm_heap(0) is False
