"""Paged KV <-> chunk-buffer transfer layer (vLLM worker process); see ``paged_copy``."""
from __future__ import annotations
