"""The one shim to the compiled gather/scatter kernels of ``csrc/`` (vLLM worker process).

Two operations, each one call for all layers of a batch of chunks:

* ``gather(layers, table, chunks)``: ``chunks[c][layer, slot] = layers[layer][block]``
* ``scatter(layers, table, chunks)``: ``layers[layer][block] = chunks[c][layer, slot]``

for every row ``(c, slot, block)`` of ``table`` (a CPU int64 tensor ``[n, 3]``).
``layers`` are block-first views of vLLM's per-layer KV tensors (any strides);
chunk buffers are contiguous ``[num_layers, blocks_per_chunk, *block_shape]``.
Rows may come in any order and repeat blocks; when two rows write the same
destination, the later row wins (both backends).

``LMI_CACHE_KERNELS`` chooses the backend: ``native`` (the csrc extension,
compiled on first use into a cache directory, see ``native_build``; failing to
load it is a start-up error), ``torch`` (``index_select``/``index_copy_``) or
``auto`` (default: native when it loads, else torch with one log line).
:func:`backend` names the backend in use. No other module imports the extension.

The extension also carries two ops for blending (CPU, float32):
:func:`scattered_attention`, causal attention of a few query tokens scattered
through a prompt, in groups that share each pass over the keys; and
:func:`rotate_pairs`, RoPE re-rotation in one pass. Serving uses them only
with the native backend (:func:`native_blend_ops`); otherwise blending
uses vLLM's kernel and torch.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from lmi_cache.errors import UserError
from lmi_cache.transfer import native_build

logger = logging.getLogger(__name__)

KERNELS_ENV = "LMI_CACHE_KERNELS"
BACKEND_CHOICES = ("auto", "native", "torch")
EXTENSION_NAME = "lmi_cache_kernels"
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
CPU_SOURCES = ("bindings.cpp", "paged_copy_cpu.cpp", "rotate_pairs_cpu.cpp", "scattered_attention_cpu.cpp")
CUDA_SOURCES = ("paged_copy_cuda.cu",)
HEADERS = ("paged_copy.h", "rotate_pairs.h", "scattered_attention.h", "scattered_attention_simd.h")

_lock = threading.Lock()
_backend: str | None = None
_ext: ModuleType | None = None
_loaded: ModuleType | None = None  # the extension once loaded (kept across reset())


class KernelBackendError(UserError):
    """``LMI_CACHE_KERNELS`` is invalid, or ``native`` was asked for and cannot load."""


def _cuda_build_wanted() -> bool:
    from torch.utils import cpp_extension

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def load_extension() -> ModuleType:
    """Build (first use) or load the native extension; raises ``native_build.NativeBuildError``."""
    global _loaded
    if _loaded is None:
        _loaded = _build_or_load()
    return _loaded


def _build_or_load() -> ModuleType:
    with_cuda = _cuda_build_wanted()
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    sources = [CSRC_DIR / n for n in names]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise native_build.NativeBuildError(f"kernel sources not found: {', '.join(missing)}")
    defines = ["-DLMI_CACHE_WITH_CUDA"] if with_cuda else []
    module, built = native_build.load_or_build(
        EXTENSION_NAME,
        sources,
        depends=[CSRC_DIR / h for h in HEADERS],
        with_cuda=with_cuda,
        # ATen's parallel_for is inline OpenMP: without -fopenmp it silently runs on one thread.
        extra_cflags=["-O3", "-fopenmp", *defines],
        extra_cuda_cflags=["-O3", *defines],
    )
    if built:
        logger.info("lmi-cache: compiled the native KV copy kernels (cuda=%s)", with_cuda)
    if torch.cuda.is_available() and not getattr(module, "with_cuda", False):
        raise native_build.NativeBuildError("the native kernels were built without CUDA (no CUDA toolkit: set CUDA_HOME)")
    return module


def _resolve() -> None:
    global _backend, _ext
    raw = os.environ.get(KERNELS_ENV, "auto")
    choice = raw.strip().lower() or "auto"
    if choice not in BACKEND_CHOICES:
        raise KernelBackendError(f"{KERNELS_ENV}={raw!r} is not one of native, torch, auto; unset it for auto")
    if choice == "torch":
        _backend, _ext = "torch", None
        logger.info("lmi-cache: KV copies use torch (%s=torch)", KERNELS_ENV)
        return
    try:
        ext = load_extension()
    except native_build.NativeBuildError as err:
        if choice == "native":
            raise KernelBackendError(
                f"{KERNELS_ENV}=native but the native kernels cannot load: {err}; "
                f"install g++ and ninja, or set {KERNELS_ENV}=torch"
            ) from None
        logger.warning("lmi-cache: native KV copy kernels unavailable (%s); using torch copies", err)
        _backend, _ext = "torch", None
        return
    _backend, _ext = "native", ext
    logger.info("lmi-cache: KV copies use the native kernels (%s=%s)", KERNELS_ENV, choice)


def backend() -> str:
    """``"native"`` or ``"torch"``: the backend in use (resolved, and compiled if needed, on first call)."""
    with _lock:
        if _backend is None:
            _resolve()
        assert _backend is not None
        return _backend


def reset() -> None:
    """Forget the resolved backend so the next call reads ``LMI_CACHE_KERNELS`` again (tests, benchmarks)."""
    global _backend, _ext
    with _lock:
        _backend, _ext = None, None


def drop_overwritten(table: torch.Tensor, to_paged: bool) -> torch.Tensor:
    """``table`` without the rows whose destination a later row writes again (later rows win)."""
    rows = table.tolist()
    dests = [r[2] for r in rows] if to_paged else [(r[0], r[1]) for r in rows]
    if len(set(dests)) == len(dests):  # the usual case, cheap for the few rows of a step
        return table
    seen: set[object] = set()
    keep: list[int] = []
    for index in range(len(dests) - 1, -1, -1):
        if dests[index] not in seen:
            seen.add(dests[index])
            keep.append(index)
    return table[sorted(keep)]


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    # CPU index ops lack fp8 kernels: move those as bytes (same bits). Other dtypes keep their own kernels.
    if tensor.element_size() != 1 or tensor.dtype in (torch.uint8, torch.int8, torch.bool):
        return tensor
    return tensor.view(torch.uint8)


def _check_table(table: torch.Tensor) -> torch.Tensor:
    if table.dtype != torch.int64 or table.device.type != "cpu" or table.dim() != 2 or table.size(1) != 3:
        raise ValueError("paged copy: the table must be a CPU int64 tensor of shape [n, 3]")
    return table.contiguous()


def _torch_copy(layers: Sequence[torch.Tensor], table: torch.Tensor, chunks: Sequence[torch.Tensor], to_paged: bool) -> None:
    views = [_as_bits(v) for v in layers]
    bufs = [_as_bits(c) for c in chunks]
    device = views[0].device
    for c in torch.unique(table[:, 0]).tolist():
        rows = table[table[:, 0] == c]
        slots, ids = rows[:, 1], rows[:, 2].to(device)
        first = int(slots[0])
        consecutive = bool(torch.equal(slots, torch.arange(first, first + len(slots))))
        slots_dev = slots.to(device)
        for layer_idx, view in enumerate(views):
            buf = bufs[c][layer_idx]
            if to_paged:
                src = buf.narrow(0, first, len(slots)) if consecutive else buf.index_select(0, slots_dev)
                view.index_copy_(0, ids, src)
            elif consecutive:
                torch.index_select(view, 0, ids, out=buf.narrow(0, first, len(slots)))
            else:
                buf.index_copy_(0, slots_dev, view.index_select(0, ids))


def _copy(layers: Sequence[torch.Tensor], table: torch.Tensor, chunks: Sequence[torch.Tensor], to_paged: bool,
          via: str | None) -> None:
    table = _check_table(table)
    if table.size(0) == 0:
        return
    if table.size(0) > 1:
        table = drop_overwritten(table, to_paged)
    name = via or backend()
    if name == "torch":
        _torch_copy(layers, table, chunks, to_paged)
        return
    ext = _ext if via is None else load_extension()
    assert ext is not None
    (ext.scatter if to_paged else ext.gather)(list(layers), table, list(chunks))


def gather(layers: Sequence[torch.Tensor], table: torch.Tensor, chunks: Sequence[torch.Tensor],
           via: str | None = None) -> None:
    """Paged blocks -> chunk buffers for every table row; ``via`` forces ``"native"``/``"torch"``."""
    _copy(layers, table, chunks, False, via)


def scatter(layers: Sequence[torch.Tensor], table: torch.Tensor, chunks: Sequence[torch.Tensor],
            via: str | None = None) -> None:
    """Chunk buffers -> paged blocks for every table row; ``via`` forces ``"native"``/``"torch"``."""
    _copy(layers, table, chunks, True, via)


def native_blend_ops() -> bool:
    """Whether blending should use :func:`scattered_attention` and :func:`rotate_pairs` (native backend in use)."""
    return backend() == "native"


def scattered_attention(q: torch.Tensor, positions: torch.Tensor, keys: Sequence[torch.Tensor],
                        values: Sequence[torch.Tensor], scale: float, isa: str = "",
                        lse: torch.Tensor | None = None) -> torch.Tensor:
    """Attention [Tq, H, D] of q [Tq, H, D] (float32, CPU) at ascending ``positions``.

    Query i attends to the keys at positions <= positions[i] (a limit only: RoPE is in q, so
    queries may share one). ``keys[s]``/``values[s]`` ([n_s, H_kv, D], any token stride) hold
    consecutive positions, laid end to end from position 0. ``lse`` ([Tq, H] float32), when
    given, receives each row's log-sum-exp of the scaled scores (to merge with attention over
    other keys). ``isa`` forces one compiled variant (tests; see :func:`scattered_attention_isas`).
    Loads the extension whatever the backend (callers check :func:`native_blend_ops`
    first); bad arguments raise ``RuntimeError`` naming the problem.
    """
    return load_extension().scattered_attention(q, positions, list(keys), list(values), float(scale), isa, lse)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = x * cos + rotate_half(x) * sin for x [outer, T, H, D] float32 (CPU), cos/sin [T, D/2].

    One pass; ``out`` (x's shape, may be a view, or x itself) is returned. Loads the extension
    whatever the backend; bad arguments raise ``RuntimeError``.
    """
    load_extension().rotate_pairs(x, cos, sin, out)
    return out


def scattered_attention_supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`scattered_attention` takes this head geometry (the kernel's own limits)."""
    return bool(load_extension().scattered_attention_supports(num_heads, num_kv_heads, head_dim))


def scattered_attention_isas() -> list[str]:
    """The vector ISAs the scattered attention runs on this CPU, widest first."""
    return list(load_extension().scattered_attention_isas())


def main() -> int:
    """``python -m lmi_cache.transfer.kernels``: build/load now and print the backend (setup, CI)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(backend())
    except KernelBackendError as err:
        print(f"error: {err}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
