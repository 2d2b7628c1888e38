"""What the placement directory tells workers, and what workers tell it back (plain data, both processes).

Scheduler -> workers (in the step's connector metadata): ``Eviction``s, applied
by each worker to its own rank before the step's loads. Workers -> scheduler
(in their per-step metadata): ``TierEvent``s: a store or promotion that
landed in a tier (``stored``), one that was planned and did not (``failed``),
and entries a worker's medium lost on its own (``dropped``: a damaged or
unreadable file, a write that failed or that a full filesystem refused). Only
``dropped`` is news to the directory; the others complete what it planned.
"""
from __future__ import annotations

from dataclasses import dataclass

# The shared store's name in instructions, whatever backs it (Redis, Valkey, S3).
REMOTE = "remote"


@dataclass(frozen=True)
class Eviction:
    """Drop ``digest`` from rank ``rank``'s ``tier``; with ``demote_to``, hand it to that tier first."""

    rank: int
    tier: str
    digest: bytes
    demote_to: str | None = None


@dataclass(frozen=True)
class TierEvent:
    """One entry of one rank's tier: its digest and payload bytes (the directory's size of it)."""

    tier: str
    digest: bytes
    payload_bytes: int = 0
    # A dropped entry a planned load did not find: "failed_load", or "key_mismatch" when a tier refused the
    # chunk's token fingerprint in that load ("": lost by the medium outside a load).
    reason: str = ""
