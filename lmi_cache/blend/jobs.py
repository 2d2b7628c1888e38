"""What the blending connector's scheduler side asks its workers to do, as plain picklable data.

Built in the vLLM scheduler process (``scheduler_plan``), bound on every
worker (``worker_jobs``). ``BlendConnectorMetadata`` extends the base
connector's metadata, so the prefix-cache loads and saves of other requests
travel beside the blend work of this step.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata


@dataclass(frozen=True)
class BlendPiece:
    """Prompt tokens [start, end) after the prefix: from a cached segment (``keys`` per rank) or computed (None)."""

    start: int
    end: int
    keys: tuple[ChunkKey, ...] | None  # per rank (segment keys, start 0)
    source: str = ""  # a cached segment: the tier the placement directory says holds it
    promote_to: str = ""  # ... and the tier it is also put into on the way (the directory reserved room; "": none)
    attention_source: str = ""  # its layer-0 attention object's tier ("": not held, layer 0 is attended in full)
    attention_promote_to: str = ""


@dataclass(frozen=True)
class BlendJob:
    """Blend one request's segments into its paged blocks before its first forward pass.

    ``prefix_tokens`` leading tokens are already exact in the paged cache (vLLM's
    own prefix cache hit); ``token_ids`` are the prompt tokens [prefix_tokens, end)
    that the pieces cover; ``block_ids`` hold tokens [0, end) and more.
    """

    req_id: str
    prefix_tokens: int
    token_ids: tuple[int, ...]
    pieces: tuple[BlendPiece, ...]
    block_ids: tuple[int, ...]
    recompute_ratios: tuple[float, ...] | None = None  # the request's own ratios; None: the configured ones

    @property
    def end(self) -> int:
        return self.prefix_tokens + len(self.token_ids)


@dataclass(frozen=True)
class SegmentStore:
    """Compute one segment's KV alone at positions 0..n-1 and store it under its segment key."""

    req_id: str
    token_ids: tuple[int, ...]
    keys: tuple[ChunkKey, ...]  # per rank
    tiers: tuple[str, ...] = ()  # where the placement directory reserved room for it
    attention_tiers: tuple[str, ...] = ()  # ... and for its layer-0 attention object (``layer0_reuse``; (): none)


@dataclass
class BlendConnectorMetadata(LmiConnectorMetadata):
    blends: list[BlendJob] = field(default_factory=list)
    segment_stores: list[SegmentStore] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return super().is_empty and not self.blends and not self.segment_stores


_ATTENTION_KEY_TAG = b"lmi-cache/blend/layer0-attention/v1"
_ATTENTION_FINGERPRINT_TAG = int.from_bytes(hashlib.blake2b(_ATTENTION_KEY_TAG + b"/fingerprint", digest_size=8).digest(),
                                            "little")


def attention_key(segment: ChunkKey) -> ChunkKey:
    """The key of a segment's layer-0 attention object (``layer0_reuse``): derived from the segment's own key (same
    tokens, model, rank). Here, torch-free, because the scheduler places these objects too."""
    digest = hashlib.blake2b(_ATTENTION_KEY_TAG + segment.digest, digest_size=16).digest()
    return ChunkKey(digest, segment.start, segment.end, segment.fingerprint ^ _ATTENTION_FINGERPRINT_TAG)


def attention_payload_bytes(num_tokens: int, num_heads: int, head_dim: int) -> int:
    """Payload bytes of a layer-0 attention object: ``[T, H, D + 1]`` float32 (``layer0_reuse.packed_shape``)."""
    return num_tokens * num_heads * (head_dim + 1) * 4
