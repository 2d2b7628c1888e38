"""The one shim to the optional compiled gather/scatter extension (vLLM worker process).

``csrc/`` may build ``lmi_cache._C`` with fused paged-block copy kernels. It is
optional: when it is absent (CPU CI, pure-Python installs) the torch
fallbacks below do the same work with ``index_select`` / ``index_copy_``,
which are device-agnostic. Nothing else imports the extension.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

_EXT: ModuleType | None = None
_EXT_CHECKED = False


def compiled_extension() -> ModuleType | None:
    """The compiled extension, or None when it is not built (imported once)."""
    global _EXT, _EXT_CHECKED
    if not _EXT_CHECKED:
        _EXT_CHECKED = True
        try:
            _EXT = importlib.import_module("lmi_cache._C")
        except ImportError:
            _EXT = None
    return _EXT


def gather_blocks(block_view: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = block_view[block_ids[i]]`` for a block-first view of one layer."""
    ext = compiled_extension()
    if ext is not None and hasattr(ext, "gather_blocks"):
        ext.gather_blocks(block_view, block_ids, out)
        return
    torch.index_select(block_view, 0, block_ids, out=out)


def scatter_blocks(block_view: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """``block_view[block_ids[i]] = src[i]``, writing through the view into vLLM's cache."""
    ext = compiled_extension()
    if ext is not None and hasattr(ext, "scatter_blocks"):
        ext.scatter_blocks(block_view, block_ids, src)
        return
    block_view.index_copy_(0, block_ids, src)
