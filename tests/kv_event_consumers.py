"""Two KV-event consumers written from their projects' documented rules, to prove events routable (test helper).

Facts, not code, from the consumers: llm-d's KV-cache indexer (``pkg/kvevents``,
``pkg/kvcache/kvblock``) and Dynamo's KV router (``lib/kv-router/src/zmq_wire.rs``,
``protocols.rs``).

Wire (both): a ZMQ message is ``[topic, seq (8 bytes, big-endian), payload]``;
the payload is a msgpack ``[ts, events, dp_rank]``; an event is either a
positional array with its tag first (older vLLM: ``["BlockStored", hashes,
parent, tokens, block_size, lora_id, medium, lora_name, ...]``) or a map with
a ``"type"`` key (vLLM's tagged structs today). ``decode_events`` reads both.

llm-d (``LlmdIndex``): a stored event's request keys are recomputed from its
token ids at the indexer's block size: FNV-64a over the canonical CBOR of
``[parent, tokens, extra]``, the first parent being ``hash(fnv64a(seed), nil,
model)``, a later one the request key the indexer mapped the event's parent
engine hash to (an unknown parent drops the event); engine hashes map 1:1 to
request keys; the tier is ``medium`` lower-cased ("gpu" when absent); a LoRA
name replaces the model name; an event without tokens adds its tier to the
request keys its engine hashes were mapped to earlier; a removal drops the
(pod, tier) entry of each engine hash's request key.

Dynamo (``DynamoIndex``): a block's local hash is xxh3-64 (seed 1337) of its
tokens as little-endian u32 at the router's block size; an event is ignored
when its ``kv_cache_spec_kind`` is not a main-attention kind or, without a
kind, when its ``group_idx`` is not 0; block hashes must be integers; blocks
whose ``block_size`` is not the router's (0 included) are not indexed; events
of a locality other than local are dropped (as the routing issue describes
Dynamo); ``medium`` picks the tier: GPU or none -> device, CPU -> host, DISK /
NVME / CPU_TIER2 -> disk, REMOTE / EXTERNAL / SHARED / NETWORK -> external, any
other name -> device (Dynamo's default: vLLM's ``STORAGE`` is not in its table);
stored blocks hang off their parent's node per worker and tier (an unknown
parent drops the event), and a prompt matches as deep as its local hashes walk.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")


@dataclass
class Event:
    kind: str  # BlockStored | BlockRemoved | AllBlocksCleared
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        return self.fields.get(name)


def decode_event(raw: Any) -> Event:
    """One event, positional array or tagged map."""
    if isinstance(raw, dict):
        return Event(str(raw["type"]), {k: v for k, v in raw.items() if k != "type"})
    tag, values = str(raw[0]), list(raw[1:])
    names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else ()
    return Event(tag, dict(zip(names, values)))


def decode_events(payload: bytes) -> list[Event]:
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    return [decode_event(raw) for raw in batch[1]]


# -- llm-d -------------------------------------------------------------------------------------


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, value)
    raise ValueError(value)


def cbor(value: Any) -> bytes:
    """Canonical CBOR of the few shapes llm-d hashes: unsigned ints, text, null, arrays of them."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value)
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    items = list(value)
    return _cbor_head(4, len(items)) + b"".join(cbor(item) for item in items)


def fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class LlmdIndex:
    """llm-d's indexer, reduced to what routing needs: request key -> {(pod, tier)}."""

    def __init__(self, block_size: int, model: str, hash_seed: str = "", pod: str = "pod-a") -> None:
        self.block_size, self.model, self.pod = block_size, model, pod
        self._seed = fnv64a(hash_seed.encode())
        self.entries: dict[int, set[tuple[str, str]]] = {}
        self._engine_to_request: dict[int, int] = {}
        self.dropped = 0

    def request_keys(self, tokens: Sequence[int], parent: int | None = None, model: str | None = None) -> list[int]:
        prefix = parent if parent is not None else fnv64a(cbor([self._seed, None, model or self.model]))
        keys = []
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            prefix = fnv64a(cbor([prefix, list(tokens[start : start + self.block_size]), None]))
            keys.append(prefix)
        return keys

    def apply(self, event: Event) -> None:
        tier = str(event.get("medium") or "gpu").lower()
        entry = (self.pod, tier)
        hashes = [self._as_u64(h) for h in event.get("block_hashes") or ()]
        if event.kind == "BlockStored":
            parent = event.get("parent_block_hash")
            parent_key = None
            if parent is not None and self._as_u64(parent) != 0:
                parent_key = self._engine_to_request.get(self._as_u64(parent))
                if parent_key is None:
                    self.dropped += 1  # the indexer cannot chain it
                    return
            keys = self.request_keys(list(event.get("token_ids") or ()), parent_key, event.get("lora_name"))
            if not keys:  # tokenless: a tier update of keys seen before
                keys = [self._engine_to_request[h] for h in hashes if h in self._engine_to_request]
                for key in keys:
                    self.entries.setdefault(key, set()).add(entry)
                return
            if len(keys) != len(hashes):
                self.dropped += 1
                return
            for engine, key in zip(hashes, keys):
                self._engine_to_request[engine] = key
                self.entries.setdefault(key, set()).add(entry)
        elif event.kind == "BlockRemoved":
            for engine in hashes:
                key = self._engine_to_request.get(engine)
                if key is not None:
                    self.entries.get(key, set()).discard(entry)

    def tiers_of(self, tokens: Sequence[int]) -> list[set[str]]:
        """For each full block of a prompt, the tiers of this pod that hold it."""
        return [{tier for pod, tier in self.entries.get(key, set()) if pod == self.pod}
                for key in self.request_keys(tokens)]

    @staticmethod
    def _as_u64(value: Any) -> int:
        if isinstance(value, bytes):
            return int.from_bytes(value[-8:].rjust(8, b"\0"), "big")
        return int(value) & 0xFFFFFFFFFFFFFFFF


# -- Dynamo ------------------------------------------------------------------------------------

MAIN_ATTENTION = {"full_attention", "mla_attention", "sink_full_attention"}
DYNAMO_TIERS = {"GPU": "device", "DEVICE": "device", "CPU": "host", "CPU_PINNED": "host", "CPU_TIER1": "host",
                "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk", "EXTERNAL": "external", "NETWORK": "external",
                "REMOTE": "external", "SHARED": "external"}


def dynamo_local_hash(tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(struct.pack("<I", t) for t in tokens), seed=1337)


class DynamoIndex:
    """Dynamo's radix tree per tier of one worker: external hash -> (local hash, children by local hash)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.trees: dict[str, dict[int | None, dict[int, int]]] = {}  # tier -> node -> {local hash: external}
        self.dropped = 0

    def apply(self, event: Event) -> None:
        kind, group = event.get("kv_cache_spec_kind"), event.get("group_idx")
        if (kind is not None and kind not in MAIN_ATTENTION) or (kind is None and group not in (None, 0)):
            return
        if event.get("locality") not in (None, "LOCAL"):
            self.dropped += 1
            return
        hashes = list(event.get("block_hashes") or ())
        if event.kind in ("BlockStored", "BlockRemoved") and not all(isinstance(h, int) for h in hashes):
            self.dropped += 1  # not an integer hash: the batch does not deserialize
            return
        tier = DYNAMO_TIERS.get(str(event.get("medium") or "GPU"), "device")
        tree = self.trees.setdefault(tier, {None: {}})
        if event.kind == "BlockStored":
            parent = event.get("parent_block_hash")
            if parent not in tree:
                self.dropped += 1
                return
            tokens, size = list(event.get("token_ids") or ()), int(event.get("block_size") or 0)
            for i, external in enumerate(hashes):
                block = tokens[i * size : (i + 1) * size]
                if size != self.block_size or len(block) != size:
                    break
                tree[parent][dynamo_local_hash(block)] = external
                tree.setdefault(external, {})
                parent = external
        elif event.kind == "BlockRemoved":
            for external in hashes:
                tree.pop(external, None)
                for children in tree.values():
                    for local, child in list(children.items()):
                        if child == external:
                            del children[local]

    def matched_blocks(self, tier: str, tokens: Sequence[int]) -> int:
        """How many leading blocks of a prompt the tier holds, walking the tree."""
        tree = self.trees.get(tier, {None: {}})
        node: int | None = None
        depth = 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            child = tree.get(node, {}).get(dynamo_local_hash(tokens[start : start + self.block_size]))
            if child is None:
                break
            node, depth = child, depth + 1
        return depth


def apply_all(events: Iterable[Event], *indexes: LlmdIndex | DynamoIndex) -> None:
    for event in events:
        for index in indexes:
            index.apply(event)
