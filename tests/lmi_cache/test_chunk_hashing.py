"""Tests for lmi_cache.keys.hashing: namespace-seeded, prefix-chained chunk keys."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.keys import hashing as chunk_hashing
from lmi_cache.keys.hashing import KEY_SCHEME_VERSION, ChunkKey, KeyNamespace, KeySpace, chunk_keys

BASE = KeyNamespace("llama-7b", "bfloat16", "cpu.s0123.bfloat16")
token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=200)
namespaces = st.builds(
    KeyNamespace,
    model=st.sampled_from(["m1", "m2"]),
    kv_dtype=st.sampled_from(["bfloat16", "fp8"]),
    layout=st.sampled_from(["v1", "v2"]),
    tp_rank=st.integers(0, 3),
    tp_size=st.sampled_from([1, 4]),
    pp_rank=st.integers(0, 1),
    pp_size=st.sampled_from([1, 2]),
    lora=st.sampled_from([None, "adapter-a", "adapter-b"]),
    cache_salt=st.sampled_from([None, "", "tenant-1"]),
    model_identity=st.sampled_from(["", "content:1f2e", "content:1f2f", "hf:" + "a" * 40]),
)


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, ns_a=namespaces, ns_b=namespaces, chunk=st.integers(1, 17))
def test_different_namespaces_never_share_keys(tokens: list[int], ns_a: KeyNamespace, ns_b: KeyNamespace,
                                               chunk: int) -> None:
    keys_a = {k.digest for k in chunk_keys(tokens, ns_a, chunk, include_partial=True)}
    keys_b = {k.digest for k in chunk_keys(tokens, ns_b, chunk, include_partial=True)}
    if ns_a == ns_b:
        assert keys_a == keys_b
    else:
        assert not keys_a & keys_b


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, chunk=st.integers(1, 17))
def test_equal_tokens_equal_keys_any_input_type(tokens: list[int], chunk: int) -> None:
    from_list = chunk_keys(tokens, BASE, chunk, include_partial=True)
    from_numpy = chunk_keys(np.array(tokens, dtype=np.int64), BASE, chunk, include_partial=True)
    assert from_list == from_numpy


@settings(max_examples=200, deadline=None)
@given(prefix=token_lists, suffix=token_lists, chunk=st.integers(1, 17))
def test_keys_are_prefix_consistent(prefix: list[int], suffix: list[int], chunk: int) -> None:
    short = chunk_keys(prefix, BASE, chunk)
    long = chunk_keys(prefix + suffix, BASE, chunk)
    assert long[: len(short)] == short


@settings(max_examples=100, deadline=None)
@given(tokens=token_lists, position=st.integers(0, 199), chunk=st.integers(1, 17))
def test_changing_a_token_changes_that_chunk_and_all_later(tokens: list[int], position: int, chunk: int) -> None:
    position %= len(tokens)
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % 2**32
    a = chunk_keys(tokens, BASE, chunk, include_partial=True)
    b = chunk_keys(changed, BASE, chunk, include_partial=True)
    first = position // chunk
    assert a[:first] == b[:first]
    for key_a, key_b in zip(a[first:], b[first:]):
        assert key_a.digest != key_b.digest and key_a.fingerprint != key_b.fingerprint


def test_chunk_ranges_and_partial() -> None:
    keys = chunk_keys(list(range(10)), BASE, 4)
    assert [(k.start, k.end) for k in keys] == [(0, 4), (4, 8)]
    keys = chunk_keys(list(range(10)), BASE, 4, include_partial=True)
    assert [(k.start, k.end) for k in keys] == [(0, 4), (4, 8), (8, 10)]
    assert all(len(k.digest) == 16 and len(k.hex) == 32 and 0 <= k.fingerprint < 2**64 for k in keys)
    assert chunk_keys([], BASE, 4) == []


def test_seed_is_deterministic_across_processes() -> None:
    code = ("from lmi_cache.keys.hashing import KeyNamespace, chunk_keys;"
            "ns = KeyNamespace('llama-7b', 'bfloat16', 'cpu-lbhnc-v1', lora='a');"
            "print(chunk_keys(list(range(64)), ns, 16)[-1].hex, ns.seed().hex())")
    outputs = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        outputs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout)
    here = KeyNamespace("llama-7b", "bfloat16", "cpu-lbhnc-v1", lora="a")
    assert outputs == {f"{chunk_keys(list(range(64)), here, 16)[-1].hex} {here.seed().hex()}\n"}


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_bad_token_ids_rejected(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        chunk_keys(bad, BASE, 4)  # type: ignore[arg-type]
    if isinstance(bad[0], int):
        with pytest.raises(ValueError):
            chunk_keys(np.array(bad, dtype=np.int64), BASE, 4)


class CountingXxhash:
    """Stands in for the xxhash module in lmi_cache.keys.hashing: counts each 128-bit digest and its input bytes."""

    def __init__(self) -> None:
        self.digest_inputs: list[int] = []
        self.xxh64_intdigest = xxhash.xxh64_intdigest

    def xxh3_128_digest(self, data: bytes, seed: int = 0) -> bytes:
        self.digest_inputs.append(len(data))
        return xxhash.xxh3_128_digest(data, seed)


TOKENS_128K = 131_072
LINK_BYTES = 16 + 256 * 4  # a chain link hashes the previous link's digest and a 256-token chunk (uint32 ids)


def test_hashing_128k_tokens_reads_each_token_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """What keeps keying a long prompt fast (timed in benchmarks/bench_keys.py): one digest per chunk over
    (previous link, chunk), never the prefix again, so the work grows with the prompt, not its square."""
    tokens = np.random.default_rng(0).integers(0, 150_000, TOKENS_128K).tolist()
    counting = CountingXxhash()
    monkeypatch.setattr(chunk_hashing, "xxhash", counting)
    keys = chunk_keys(tokens, BASE, 256)
    assert len(keys) == TOKENS_128K // 256
    links = [n for n in counting.digest_inputs if n == LINK_BYTES]
    others = [n for n in counting.digest_inputs if n != LINK_BYTES]  # the namespace's seed, once
    assert len(links) == len(keys) and len(others) <= 2 and sum(others) < 1024, others


def test_chunkkey_is_hashable_value() -> None:
    key = ChunkKey(b"\x01" * 16, 0, 4, 7)
    assert {key: 1}[ChunkKey(b"\x01" * 16, 0, 4, 7)] == 1


def test_other_weights_at_the_same_path_get_other_keys() -> None:
    """A model replaced in place keeps its path and dtype; only the identity of its weights tells them apart."""
    old = KeyNamespace("/opt/ml/model", "bfloat16", "cpu-lbhnc-v1", model_identity="content:aaaa")
    new = KeyNamespace("/opt/ml/model", "bfloat16", "cpu-lbhnc-v1", model_identity="content:bbbb")
    tokens = list(range(64))
    assert not {k.digest for k in chunk_keys(tokens, old, 16)} & {k.digest for k in chunk_keys(tokens, new, 16)}


# -- KeySpace: one chain per request, every rank's key derived from it -----------------------------

SPACE = KeySpace("llama-7b", "bfloat16", "cpu.s0123.bfloat16", chunk_size=16, tp_size=4, pp_size=2)
spaces = st.builds(
    KeySpace,
    model=st.sampled_from(["m1", "m2"]),
    kv_dtype=st.sampled_from(["bfloat16", "fp8"]),
    layout=st.sampled_from(["cpu.s0123.bfloat16", "flash_nhd.s01234.bfloat16"]),
    chunk_size=st.sampled_from([4, 5]),
    tp_size=st.sampled_from([1, 2]),
    pp_size=st.sampled_from([1, 2]),
    model_identity=st.sampled_from(["", "content:1f2e", "content:1f2f"]),
)
requests = st.tuples(spaces, st.sampled_from([None, "adapter-a", "adapter-b"]),
                     st.sampled_from([None, "", "tenant-1"]), st.integers(0, 3))


def reference_keys(space: KeySpace, tokens: list[int], rank: int, lora: str | None, salt: str | None) -> list[ChunkKey]:
    """The v3 scheme spelled out with streaming hashes: chain once, then (rank seed || link) per rank."""
    seed = space.request_seed(lora, salt)
    rank_seed = xxhash.xxh3_128_digest(json.dumps([KEY_SCHEME_VERSION, "rank", rank % space.tp_size,
                                                   rank // space.tp_size], separators=(",", ":")).encode())
    keys, prev, prev_fp = [], seed, seed
    full = len(tokens) - len(tokens) % space.chunk_size
    for start in range(0, full, space.chunk_size):
        body = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + space.chunk_size])
        digest = xxhash.xxh3_128(prev)
        digest.update(body)
        prev = digest.digest()
        fingerprint = xxhash.xxh64(prev_fp, seed=0x6C6D692D66707631)
        fingerprint.update(body)
        prev_fp = fingerprint.digest()[::-1]  # xxh64.digest() is big-endian; the chain links little-endian bytes
        keys.append(ChunkKey(xxhash.xxh3_128_digest(rank_seed + prev), start, start + space.chunk_size,
                             xxhash.xxh64_intdigest(rank_seed + prev_fp, 0x6C6D692D66707631)))
    return keys


@settings(max_examples=100, deadline=None)
@given(tokens=token_lists, request=requests)
def test_hashing_once_equals_each_ranks_own_derivation(tokens: list[int], request: tuple) -> None:
    space, lora, salt, _ = request
    per_request = space.for_request(tokens, lora, salt)
    assert len(per_request) == len(tokens) // space.chunk_size
    for rank in range(space.world_size):
        expected = reference_keys(space, tokens, rank, lora, salt)
        assert per_request.rank(rank) == expected == space.keys(tokens, rank, lora, salt)
        assert [keys[rank] for keys in per_request.per_chunk] == expected


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=60), a=requests, b=requests)
def test_any_namespace_field_rank_adapter_or_salt_changes_every_key(tokens: list[int], a: tuple, b: tuple) -> None:
    (space_a, lora_a, salt_a, rank_a), (space_b, lora_b, salt_b, rank_b) = a, b
    rank_a, rank_b = rank_a % space_a.world_size, rank_b % space_b.world_size
    keys_a = space_a.keys(tokens, rank_a, lora_a, salt_a, include_partial=True)
    keys_b = space_b.keys(tokens, rank_b, lora_b, salt_b, include_partial=True)
    if (space_a, lora_a, salt_a, rank_a) == (space_b, lora_b, salt_b, rank_b):
        assert keys_a == keys_b
    else:
        assert not {k.digest for k in keys_a} & {k.digest for k in keys_b}
        assert not {k.fingerprint for k in keys_a} & {k.fingerprint for k in keys_b}


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=120), position=st.integers(0, 119))
def test_changing_any_earlier_token_changes_every_later_key_on_every_rank(tokens: list[int], position: int) -> None:
    position %= len(tokens)
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % 2**32
    a, b = SPACE.for_request(tokens).per_chunk, SPACE.for_request(changed).per_chunk
    first = position // SPACE.chunk_size
    assert a[:first] == b[:first]
    for keys_a, keys_b in zip(a[first:], b[first:]):
        for key_a, key_b in zip(keys_a, keys_b):
            assert key_a.digest != key_b.digest and key_a.fingerprint != key_b.fingerprint


def test_ranks_never_share_a_key_and_chunks_keep_their_ranges() -> None:
    keys = SPACE.for_request(list(range(70)), include_partial=True).per_chunk
    assert [(row[0].start, row[0].end) for row in keys] == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]
    assert all(len(row) == 8 and {(k.start, k.end) for k in row} == {(row[0].start, row[0].end)} for row in keys)
    flat = [k for row in keys for k in row]
    assert len({k.digest for k in flat}) == len({k.fingerprint for k in flat}) == len(flat) == 40
    assert SPACE.for_request([]).per_chunk == ()


def test_the_scheme_version_was_bumped_so_v2_chunks_stop_matching(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks persisted by the per-rank (v2) scheme must never be found by current keys."""
    tokens = list(range(64))
    current = {k.digest for r in range(SPACE.world_size) for k in SPACE.keys(tokens, r)}
    monkeypatch.setattr(chunk_hashing, "KEY_SCHEME_VERSION", "lmi-cache-keys-v2")
    v2 = {k.digest
          for r in range(SPACE.world_size)
          for k in chunk_keys(tokens, KeyNamespace("llama-7b", "bfloat16", "cpu.s0123.bfloat16", tp_rank=r % 4,
                                                   tp_size=4, pp_rank=r // 4, pp_size=2), 16)}
    assert len(v2) == len(current) == 32 and not v2 & current


def test_the_scheme_version_was_bumped_so_v3_chunks_stop_matching(monkeypatch: pytest.MonkeyPatch) -> None:
    """v3 keyed an image's placeholder tokens as text: none of its chunks may be found by v4 keys."""
    assert KEY_SCHEME_VERSION == "lmi-cache-keys-v4"
    tokens = list(range(64))
    # Pinned: a change of the derivation that forgets to bump the version fails here.
    assert SPACE.keys(tokens, 5, lora="a", cache_salt="s")[-1].hex == GOLDEN_V4
    v4 = {k.digest for r in range(SPACE.world_size) for k in SPACE.keys(tokens, r)}
    monkeypatch.setattr(chunk_hashing, "KEY_SCHEME_VERSION", "lmi-cache-keys-v3")
    v3_space = dataclasses.replace(SPACE)  # a fresh instance: its rank seeds are derived under v3 too
    v3 = {k.digest for r in range(SPACE.world_size) for k in v3_space.keys(tokens, r)}
    assert len(v3) == len(v4) == 32 and not v3 & v4


GOLDEN_V4 = "f11e4c27657fd22dd99e66640c5b39e9"  # SPACE, tokens 0..63, rank 5, lora "a", salt "s": last chunk


def test_key_space_is_deterministic_across_processes() -> None:
    code = ("from lmi_cache.keys.hashing import KeySpace;"
            "s = KeySpace('m', 'bfloat16', 'cpu.s0123.bfloat16', 16, tp_size=2);"
            "print(s.for_request(list(range(64)), 'a', 's').per_chunk[-1][1].hex)")
    outputs = {subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=seed),
                              capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    here = KeySpace("m", "bfloat16", "cpu.s0123.bfloat16", 16, tp_size=2)
    assert outputs == {here.keys(list(range(64)), 1, "a", "s")[-1].hex + "\n"}


@pytest.mark.parametrize("field,value", [("chunk_size", 0), ("tp_size", 0), ("pp_size", -1), ("tp_size", 1.5)])
def test_bad_key_space_sizes_are_one_clear_error(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"KeySpace.{field} must be a positive integer"):
        KeySpace("m", "bfloat16", "t", **{"chunk_size": 16, field: value})  # type: ignore[arg-type]


def test_a_rank_outside_the_key_space_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 8 is outside"):
        SPACE.keys([1, 2, 3], 8)
    with pytest.raises(ValueError):
        SPACE.for_request([-1])


def test_a_request_hashes_its_tokens_once_for_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight ranks' keys of a 128k-token prompt: the tokens are hashed once (one chain), and each rank's key is
    one short hash of its seed and the chain's link (timed in benchmarks/bench_keys.py)."""
    tokens = np.random.default_rng(0).integers(0, 150_000, TOKENS_128K).tolist()
    space = KeySpace("m", "bfloat16", "cpu.s0123.bfloat16", 256, tp_size=8)
    counting = CountingXxhash()
    monkeypatch.setattr(chunk_hashing, "xxhash", counting)
    keys = space.for_request(tokens)
    chunks = TOKENS_128K // 256
    assert len(keys.per_chunk) == chunks and all(len(ranks) == 8 for ranks in keys.per_chunk)
    links = [n for n in counting.digest_inputs if n == LINK_BYTES]
    rank_keys = [n for n in counting.digest_inputs if n == 32]  # a rank's seed and the link's digest
    others = [n for n in counting.digest_inputs if n not in (LINK_BYTES, 32)]  # the namespace and rank seeds
    # chunks x 8 rank keys, plus at most the 8 rank seeds (their canonical form is 32 bytes too)
    assert len(links) == chunks and chunks * 8 <= len(rank_keys) <= chunks * 8 + 8
    assert len(others) <= 16 and sum(others) < 16 * 1024, others
