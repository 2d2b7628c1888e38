"""A bounded memory of recently seen digests (vLLM scheduler process, torch-free).

The placement directory remembers a few things for a while only: the digests
it wrote to the remote store lately (written once), the entries it evicted or
lost lately (a miss on them is an eviction's), and the pending stores it
evicted before their confirmation came. Each is a ``RecentDigests``: the
oldest are forgotten first, so none grows without bound.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class RecentDigests:
    """A bounded set of recently seen digests, oldest forgotten first."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, digest: object) -> bool:
        return digest in self._seen

    def admit(self, digests: Sequence[bytes]) -> bool:
        """True (and remember them) unless every digest was seen lately."""
        if digests and all(d in self._seen for d in digests):
            return False
        for digest in digests:
            self._seen[digest] = None
            self._seen.move_to_end(digest)
        while len(self._seen) > self._limit:
            self._seen.popitem(last=False)
        return True

    def take(self, digest: bytes) -> bool:
        """Whether ``digest`` was seen lately, forgetting it."""
        if digest not in self._seen:
            return False
        del self._seen[digest]
        return True
