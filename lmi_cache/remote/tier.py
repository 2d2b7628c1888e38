"""RemoteTier: the remote store as the engine's tier behind CPU and disk (vLLM worker process).

The engine hands it every newly stored chunk object (``offer``: queued, never
waited for) and asks it for chunks its local tiers miss: ``stage`` fetches the
chunks of one load step in one batched GET (the worker calls it before
copying), ``take`` returns one verified chunk (staged, or fetched alone) and
``fill`` copies it into a tensor. A miss or fault of any kind is None, counted
by ``RemoteCache``; nothing here raises after construction.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np
import torch

from lmi_cache.chunk_hashing import ChunkKey
from lmi_cache.metrics import CacheMetrics, RateLimitedWarner
from lmi_cache.remote.cache import RemoteCache
from lmi_cache.remote.factory import open_remote
from lmi_cache.remote.settings import RemoteSettings
from lmi_cache.remote.value_codec import DecodedChunk
from lmi_cache.tiers.buffers import torch_dtype

logger = logging.getLogger(__name__)
MAX_STAGED = 4096  # chunks fetched ahead and not yet taken (one step's loads are far fewer)


class RemoteTier:
    """Batched, verified reads and queued writes of chunk objects against one remote store."""

    def __init__(self, settings: RemoteSettings, *, metrics: CacheMetrics, warner: RateLimitedWarner) -> None:
        self.cache: RemoteCache = open_remote(settings, metrics=metrics, warner=warner)
        self.name = self.cache.name  # "redis" or "s3": the metrics' tier label
        self._staged: dict[bytes, DecodedChunk | None] = {}  # None: fetched this step and missing
        self._lock = threading.Lock()
        logger.info("lmi-cache: remote tier on: %s store %s (compression %s, MAC %s)", self.name,
                    settings.display_url, settings.compression, "on" if self.cache.codec.has_mac else "off")

    def offer(self, key: ChunkKey, obj: np.ndarray) -> bool:
        """Queue a chunk object (header + payload bytes) for the store; False when dropped (counted)."""
        return self.cache.put(key, obj)

    def stage(self, keys: Sequence[ChunkKey]) -> int:
        """Fetch ``keys`` in one batched round trip and keep the outcomes for ``take``; how many were found."""
        if not keys:
            return 0
        results = self.cache.get_many(keys)
        # A miss is kept too: the load that follows must not ask the store a second time.
        outcomes = {k.digest: r if isinstance(r, DecodedChunk) else None for k, r in zip(keys, results)}
        with self._lock:
            if len(self._staged) + len(outcomes) > MAX_STAGED:
                self._staged.clear()  # leftovers of loads that never happened
            self._staged.update(outcomes)
        return sum(r is not None for r in outcomes.values())

    def take(self, key: ChunkKey) -> DecodedChunk | None:
        """The verified chunk for ``key``: staged by ``stage``, else fetched now; None on a miss."""
        with self._lock:
            if key.digest in self._staged:
                return self._staged.pop(key.digest)
        result = self.cache.get_many([key])[0]
        return result if isinstance(result, DecodedChunk) else None

    def flush(self, timeout_s: float) -> bool:
        return self.cache.flush(timeout_s)

    def stats(self) -> dict[str, int]:
        return {f"remote_{name}": value for name, value in self.cache.stats().items()}

    def close(self) -> None:
        with self._lock:
            self._staged.clear()
        self.cache.close()


def fill_from(chunk: DecodedChunk, out: torch.Tensor | None) -> torch.Tensor:
    """The chunk's payload in ``out`` (same dtype and byte size) or in a new tensor of the stored shape."""
    header = chunk.header
    dtype = torch_dtype(header.dtype)
    source = np.frombuffer(chunk.payload, dtype=np.uint8)
    if out is not None and (out.dtype != dtype or out.numel() * out.element_size() != header.payload_bytes
                            or not out.is_contiguous()):
        raise ValueError("out tensor does not match the stored chunk's dtype and size")
    if out is not None and out.device.type == "cpu":
        np.copyto(out.detach().reshape(-1).view(torch.uint8).numpy(), source)
        return out
    result = torch.empty(header.shape, dtype=dtype)
    np.copyto(result.reshape(-1).view(torch.uint8).numpy(), source)
    if out is not None:
        out.copy_(result)
        return out
    return result
