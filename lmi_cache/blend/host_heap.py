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

Raising the thresholds is not enough on its own. The heap still grows into
fresh pages whenever a blend's blocks do not fit the free space that other
requests left fragmented, and on the project's VM a fresh page costs about
10 us to fault in: in a profile of paired RAG requests (blend, then the same
prompt with no cache and with prefix caching; ``benchmarks/profile_blend.py
--paired --prewarm-mib 0``) one blend's first-layer
projections took 28,632 faults and 339 ms instead of about 300 faults and
55 ms. ``prewarm_heap`` therefore touches a block of heap once at start and
frees it; glibc keeps it (below the trim threshold) as touched free memory
that later blocks are carved from. With 768 MiB the same profile saw at most
3,400 faults per blend and no such outliers. The blending connector sizes the
block from the model and ``max_model_len`` (``blend_heap_bytes``, at most 960 MiB).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
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

PREWARM_MIN_BYTES = 64 << 20
PREWARM_MAX_BYTES = 960 << 20  # below the 1 GiB mmap threshold (one block), under half the trim threshold


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


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's glibc with mallopt/malloc/free typed, once (find_library runs ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc's mallopt takes these parameters
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.malloc.argtypes, libc.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
        libc.free.argtypes, libc.free.restype = (ctypes.c_void_p,), None
    except (OSError, AttributeError):
        return None
    return libc


def _glibc_mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    libc = _glibc()
    return None if libc is None else libc.mallopt


def blend_heap_bytes(num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int) -> int:
    """The heap to prewarm for blending prompts of up to ``max_tokens`` on one rank.

    Sixteen times a whole prompt's float32 K of every layer, clamped to [64 MiB, 960 MiB]
    (larger blocks are mmapped anyway). The blend's re-rotated K and V take two of those;
    the first layers' activations and vLLM's own forward of the other requests scale with
    the prompt too. Measured: after six paired RAG requests on the 8-layer test model
    (8,143 tokens: 67 MB of K, so the 960 MiB cap here) glibc's heap had grown to 958 MiB; 255 MiB
    prewarmed still left a blend with 25,229 faults, 768 MiB none over 3,400
    (``benchmarks/profile_blend.py --paired --prewarm-mib N``).
    """
    wanted = 16 * num_layers * num_kv_heads * head_dim * 4 * max(0, max_tokens)
    return max(PREWARM_MIN_BYTES, min(PREWARM_MAX_BYTES, wanted))


def prewarm_heap(num_bytes: int) -> bool:
    """Touch ``num_bytes`` of heap once and free it (call after ``keep_large_allocations_in_heap``).

    False (and nothing done) without glibc, above the mmap threshold, or if malloc fails.
    """
    libc = _glibc()
    if libc is None or num_bytes <= 0 or num_bytes >= HEAP_MMAP_THRESHOLD_BYTES:
        return False
    block = libc.malloc(num_bytes)
    if not block:
        logger.info("lmi-cache: could not prewarm %d MiB of heap for blending (malloc failed)", num_bytes >> 20)
        return False
    try:
        ctypes.memset(block, 0, num_bytes)  # faults every page in now, at start, not during a blend
    finally:
        libc.free(block)
    logger.info("lmi-cache: prewarmed %d MiB of heap for the blend's temporaries", num_bytes >> 20)
    return True


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
