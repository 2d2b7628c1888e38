"""Keep the blend's large temporaries in the C heap (vLLM CPU worker process, glibc only).

A blended request runs its first layers over every prompt token at once: on an
8k-token prompt the MLP's intermediate, the re-rotated K/V of all layers and
the hidden states are tens to hundreds of MiB each. glibc serves any
allocation above its mmap threshold (at most 32 MiB by default) with a fresh
``mmap`` and unmaps it on free, so every blend faults all of those pages in
again (in a one-off measurement on the project's 2-core VM, a 132 MB buffer
took 34 ms fresh and 5 ms reused; ``bench_blend_rag.py --paired`` on the
8-layer test model went from 1.7x to 2.2-2.3x faster than no cache with this
module and the sliced MLP of ``blender.finish_rows``).

``keep_large_allocations_in_heap`` raises glibc's mmap and trim thresholds
(``mallopt``, the same settings as ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``), so blocks up to the threshold come from the heap
and are reused by the next blend. The price is resident memory: up to the
trim threshold of freed heap stays mapped (it is reused, not leaked). A value
already set in the environment is only ever raised, never lowered.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

HEAP_MMAP_THRESHOLD_BYTES = 1 << 30  # blocks up to 1 GiB from the heap: a blend's largest temporaries
HEAP_TRIM_THRESHOLD_BYTES = 2**31 - 1  # keep up to 2 GiB of freed heap for the next blend (mallopt: a C int)

ENV_NAMES = {M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_"}


def _env_bytes(env: Mapping[str, str], name: str) -> int:
    try:
        return max(0, int(env.get(name, "0").strip() or 0))
    except ValueError:
        return 0  # glibc ignores a malformed value too


def wanted_thresholds(env: Mapping[str, str] | None = None) -> dict[int, int]:
    """The mallopt values to set: ours, or the environment's where it asks for more."""
    env = os.environ if env is None else env
    ours = {M_MMAP_THRESHOLD: HEAP_MMAP_THRESHOLD_BYTES, M_TRIM_THRESHOLD: HEAP_TRIM_THRESHOLD_BYTES}
    return {param: max(value, _env_bytes(env, ENV_NAMES[param])) for param, value in ours.items()}


def _glibc_mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc's mallopt takes these parameters
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_large_allocations_in_heap(env: Mapping[str, str] | None = None) -> bool:
    """Raise this process's mmap/trim thresholds (see the module docstring); False where glibc refuses or is absent."""
    mallopt = _glibc_mallopt()
    if mallopt is None:
        logger.info("lmi-cache: not glibc; a blend's large temporaries are mapped fresh each time")
        return False
    wanted = wanted_thresholds(env)
    # A larger value from the environment is capped to what mallopt's C int parameter holds.
    ok = all(mallopt(param, min(value, 2**31 - 1)) == 1 for param, value in wanted.items())
    if ok:
        logger.info("lmi-cache: blend temporaries up to %d MiB come from the heap and are reused (mallopt)",
                    wanted[M_MMAP_THRESHOLD] >> 20)
    else:
        logger.info("lmi-cache: glibc refused the blend's heap thresholds; its large temporaries are mapped fresh")
    return ok
