"""What the scheduler learns from the workers' first reports: their KV layout and chunk sizes (vLLM scheduler process).

The key namespace includes the KV layout tag, which only the workers know
(they see vLLM's KV cache tensors), so no key can be built until the first
worker reports it. Ranks that disagree on the layout, a layout that changes,
or a key space that does not match the scheduler's geometry turn lookups off
(one error line naming why). Each rank's chunk sizes go to the placement
directory; the workers send both until the scheduler has every rank's
(``known``, sent back as ``LmiConnectorMetadata.layout_known``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from lmi_cache.keys.hashing import KeySpace
from lmi_cache.keys.kv_groups import is_single_full_group
from lmi_cache.placement.directory import PlacementDirectory
from lmi_cache.vllm_connector.metadata import LmiWorkerMeta
from lmi_cache.vllm_connector.request_plan import SchedulerGeometry

logger = logging.getLogger(__name__)

# Builds the deployment's key space once the workers have reported their KV layout tag.
KeySpaceFactory = Callable[[str], KeySpace]


class WorkerLayouts:
    """The layout tag, the key space per KV cache group once it is known, and why lookups are off (if they are)."""

    def __init__(self, geometry: SchedulerGeometry, key_space: KeySpaceFactory, directory: PlacementDirectory,
                 on_key_space: Callable[[KeySpace], None] | None = None) -> None:
        self._geometry = geometry
        self._key_space_factory = key_space
        self._directory = directory
        self._on_key_space = on_key_space  # the peer tier's identity follows the key space
        self.layout_tag: str | None = None
        self.key_space: KeySpace | None = None  # set with layout_tag
        self.group_spaces: tuple[KeySpace, ...] = ()  # one per KV cache group
        self.disabled_reason: str | None = None
        self._sized_ranks: set[int] = set()  # ranks whose chunk sizes arrived

    @property
    def known(self) -> bool:
        """The scheduler has the layout tag and every rank's chunk sizes: the workers stop sending them."""
        return self.layout_tag is not None and len(self._sized_ranks) >= self._geometry.world_size

    def update(self, worker_meta: LmiWorkerMeta) -> None:
        tags = set(worker_meta.layout_tags.values())
        if len(tags) > 1 and self.disabled_reason is None:
            self._disable(f"ranks disagree on the KV layout: {sorted(tags)}")
        elif tags and self.layout_tag is None:
            self.layout_tag = tags.pop()
            self._set_key_space(self.layout_tag)
        elif tags and self.layout_tag not in tags and self.disabled_reason is None:
            self._disable(f"KV layout changed from {self.layout_tag} to {sorted(tags)}")
        for rank, sizes in worker_meta.chunk_bytes.items():
            self._sized_ranks.add(rank)
            for group, payload_bytes in sizes.items():
                self._directory.sizes.set_chunk_bytes(rank, group, payload_bytes)

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        logger.error("lmi-cache: %s; cache lookups disabled", reason)

    def _set_key_space(self, layout_tag: str) -> None:
        space = self._key_space_factory(layout_tag)
        geo = self._geometry
        if space.chunk_size != geo.chunk_size_tokens or space.world_size != geo.world_size:
            self._disable(f"the key space ({space.chunk_size}-token chunks, {space.world_size} ranks) does not match "
                          f"the scheduler ({geo.chunk_size_tokens}-token chunks, {geo.world_size} ranks)")
            return
        self.key_space = space
        if self._on_key_space is not None:
            self._on_key_space(space)
        # One full-attention group keeps the keys of the group-unaware scheme; otherwise every group is named.
        single = is_single_full_group(geo.groups)
        self.group_spaces = tuple(space if single else replace(space, kv_group=g.key_tag) for g in geo.groups)
