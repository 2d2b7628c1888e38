"""What the disk tier's chunks say in KV events, kept next to them across restarts (vLLM scheduler process).

A chunk file holds KV bytes and a token fingerprint, not vLLM's block hashes
or the token ids a router needs. So that a restarted server's first events
announce the files it adopts, the scheduler appends one JSON line per chunk
the disk tier announces (our digests per rank and the ``ChunkBlocks`` of its
``BlockStored``) to ``events-dp<replica>.jsonl`` in the first disk directory.
At start, each line whose digests the directory adopted is described again
(announced at once); the file is then rewritten with those lines only, and
again whenever it grows past a few times the chunks it describes.

The file is only a hint: a line that does not parse, or names files that are
gone, is skipped; a file over ``MAX_JOURNAL_BYTES`` is not read (the chunks are
then announced when a request for them comes); a write that fails turns the
journal off with one warning. It never changes what is cached or loaded.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from lmi_cache.placement.events import BlockHash, ChunkBlocks

logger = logging.getLogger(__name__)

MAX_JOURNAL_BYTES = 1 << 30  # ~400k chunks of 256 tokens; beyond that the files are announced as requests come
JOURNAL_SLACK = 4  # rewrite once the file holds this many times the lines it needs (and at least REWRITE_MIN_LINES)
REWRITE_MIN_LINES = 1024

Record = tuple[tuple[bytes, ...], ChunkBlocks]


def journal_path(local_disk: Sequence[str], replica: int) -> str | None:
    return os.path.join(local_disk[0], f"events-dp{replica}.jsonl") if local_disk else None


def _hash_out(value: BlockHash | None) -> Any:
    return value.hex() if isinstance(value, bytes) else value


def _hash_in(value: Any) -> BlockHash | None:
    if value is None or isinstance(value, int):
        return value
    return bytes.fromhex(str(value))


def _encode(digests: Sequence[bytes], blocks: ChunkBlocks) -> str:
    return json.dumps({
        "digests": [d.hex() for d in digests], "hashes": [_hash_out(h) for h in blocks.block_hashes],
        "parent": _hash_out(blocks.parent_block_hash), "tokens": list(blocks.token_ids),
        "block_size": blocks.block_size, "lora_name": blocks.lora_name, "lora_id": blocks.lora_id,
        "extra_keys": None if blocks.extra_keys is None else [None if k is None else list(k) for k in blocks.extra_keys],
        "group": blocks.group_idx, "kind": blocks.kv_cache_spec_kind, "window": blocks.kv_cache_spec_sliding_window,
    }, separators=(",", ":"))


def _decode(line: str) -> Record:
    item = json.loads(line)
    extra = item.get("extra_keys")
    blocks = ChunkBlocks(
        block_hashes=tuple(_hash_in(h) for h in item["hashes"]),  # type: ignore[misc]  # never None in a list
        parent_block_hash=_hash_in(item.get("parent")),
        token_ids=tuple(int(t) for t in item["tokens"]),
        block_size=int(item["block_size"]),
        lora_name=item.get("lora_name"),
        lora_id=item.get("lora_id"),
        extra_keys=None if extra is None else tuple(None if k is None else tuple(k) for k in extra),
        group_idx=int(item.get("group") or 0),
        kv_cache_spec_kind=item.get("kind"),
        kv_cache_spec_sliding_window=item.get("window"),
    )
    return tuple(bytes.fromhex(d) for d in item["digests"]), blocks


class EventJournal:
    """See the module docstring."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lines = 0
        self._broken = False

    def load(self) -> list[Record]:
        """The records of the file, oldest first (bad lines skipped)."""
        try:
            if os.path.getsize(self.path) > MAX_JOURNAL_BYTES:
                logger.warning("lmi-cache: %s is over %d bytes; not read", self.path, MAX_JOURNAL_BYTES)
                return []
            with open(self.path, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except FileNotFoundError:
            return []
        except OSError as err:
            logger.warning("lmi-cache: could not read %s (%s); disk chunks are announced as requests come", self.path, err)
            return []
        records: list[Record] = []
        for line in lines:
            try:
                records.append(_decode(line))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line, or not ours
        return records

    def append(self, digests: Sequence[bytes], blocks: ChunkBlocks) -> None:
        self._write([_encode(digests, blocks)], "a")

    def rewrite(self, records: Iterable[Record]) -> None:
        lines = [_encode(digests, blocks) for digests, blocks in records]
        self._lines = 0
        self._write(lines, "w")

    def needs_rewrite(self, live_records: int) -> bool:
        return self._lines > max(REWRITE_MIN_LINES, JOURNAL_SLACK * live_records)

    def _write(self, lines: list[str], mode: str) -> None:
        if self._broken:
            return
        try:
            if mode == "w":
                tmp = f"{self.path}.tmp"
                with open(tmp, "w", encoding="utf-8") as file:
                    file.writelines(line + "\n" for line in lines)
                os.replace(tmp, self.path)
            else:
                with open(self.path, "a", encoding="utf-8") as file:
                    file.writelines(line + "\n" for line in lines)
            self._lines += len(lines)
        except FileNotFoundError:
            pass  # the disk tier has not made its directory yet: these lines are lost, later ones are kept
        except OSError as err:
            self._broken = True
            logger.warning("lmi-cache: could not write %s (%s); a restart announces disk chunks as requests come",
                           self.path, err)
