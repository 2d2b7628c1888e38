"""Tests for lmi_cache.engine.CacheEngine: the API contract the connector relies on."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmi_cache.keys.hashing import ChunkKey, KeyNamespace
from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.engine import CacheEngine
from lmi_cache.tiers.disk import object_files
from lmi_cache.metrics.worker_series import safety_net_firings
from directed_engine import Directed  # noqa: E402
from engine_verbs import all_tiers, held_by, keys_for, load, load_many, lookup, lookup_tokens, save, tier  # noqa: E402
from disk_verbs import scan_persisted_digests  # noqa: E402

NS = KeyNamespace("tiny-llama", "float32", "cpu-lbhnc-v1")
TOKENS = list(range(1000, 1000 + 16 * 20))
CHUNK_SHAPE = (2, 16, 8)  # 1 KiB of float32 per chunk
CHUNK_OBJECT_BYTES = 4096  # the CPU tier's size class for one chunk
PAYLOAD_BYTES = 1024


def data_for(key: ChunkKey) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32).reshape(CHUNK_SHAPE) + key.start


def config(tmp_path: Path | None = None, **kwargs: object) -> CacheConfig:
    fields: dict[str, object] = {"chunk_size": 16, "max_local_cpu_size": 1 / 1024}
    if tmp_path is not None:
        fields.update(local_disk=(str(tmp_path),), max_local_disk_size=1 / 1024)
    fields.update(kwargs)
    return CacheConfig(**fields)  # type: ignore[arg-type]


def test_store_retrieve_lookup(tmp_path: Path) -> None:
    with CacheEngine(config()) as engine:
        keys = keys_for(engine, TOKENS, NS)
        for key in keys[:3] + keys[4:6]:
            data = data_for(key)
            assert save(engine, key, data)
            data.zero_()  # the engine copied it
        assert lookup(engine, keys) == keys[2].end == lookup_tokens(engine, TOKENS, NS)
        assert held_by(engine, keys[0]) == "cpu" and held_by(engine, keys[3]) is None
        got = load(engine, keys[1])
        assert got is not None and torch.equal(got, data_for(keys[1]))
        out = torch.empty(CHUNK_SHAPE)
        assert load(engine, keys[2], out=out) is out and torch.equal(out, data_for(keys[2]))
        assert load(engine, keys[3]) is None
        assert lookup(engine, []) == 0
        stats = engine.stats()
        # Two chunks read back from the CPU tier; lookups are the scheduler's metric, not the engine's.
        assert stats["cpu_loaded_tokens"] == 2 * 16 and stats["cpu_entries"] == 5 and "lookups" not in stats


def test_bfloat16_and_odd_shapes() -> None:
    with CacheEngine(config()) as engine:
        key = keys_for(engine, TOKENS, NS)[0]
        data = torch.randn(3, 1, 7).to(torch.bfloat16)
        assert save(engine, key, data)
        got = load(engine, key)
        assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, data)


def test_min_retrieve_tokens_and_partial_chunks() -> None:
    with CacheEngine(config(min_retrieve_tokens=40, save_unfull_chunk=True)) as engine:
        keys = keys_for(engine, TOKENS[:40], NS)
        assert [(k.start, k.end) for k in keys] == [(0, 16), (16, 32), (32, 40)]
        save(engine, keys[0], data_for(keys[0]))
        assert lookup(engine, keys) == 0  # 16 < 40
        save(engine, keys[1], data_for(keys[1]))
        save(engine, keys[2], torch.ones(2, 8, 8))
        assert lookup_tokens(engine, TOKENS[:40], NS) == 40


def test_namespaces_isolate(tmp_path: Path) -> None:
    with CacheEngine(config()) as engine:
        for key in keys_for(engine, TOKENS, NS):
            save(engine, key, data_for(key))
        assert lookup_tokens(engine, TOKENS, NS) == len(TOKENS)
        for other in (KeyNamespace("tiny-llama", "float32", "cpu-lbhnc-v1", cache_salt="t2"),
                      KeyNamespace("tiny-llama", "float32", "cpu-lbhnc-v1", lora="a"),
                      KeyNamespace("tiny-llama", "float32", "cpu-lbhnc-v1", tp_rank=1, tp_size=2)):
            assert lookup_tokens(engine, TOKENS, other) == 0


def test_disk_hit_is_promoted_and_events(tmp_path: Path) -> None:
    # CPU holds 4 chunks, disk holds all 20: the directory evicts early chunks from CPU; they stay on disk.
    fired = safety_net_firings()
    with Directed(config(tmp_path, max_local_cpu_size=4 * CHUNK_OBJECT_BYTES / 1024**3), PAYLOAD_BYTES) as d:
        engine = d.engine
        keys = keys_for(engine, TOKENS, NS)
        for key in keys:
            assert d.save(key, data_for(key)) == ("cpu", "disk")
        engine.flush()
        assert d.held("cpu") == d.planned("cpu") == {k.digest for k in keys[-4:]}  # the tier holds what it is told
        assert d.sources(keys) == ["disk"] * 16 + ["cpu"] * 4
        got = d.load(keys[0])
        assert got is not None and torch.equal(got, data_for(keys[0]))
        assert d.sources(keys[:1]) == ["cpu"] and keys[0].digest in d.held("cpu")  # promoted, room made first
        assert d.held("cpu") == d.planned("cpu") and len(d.held("cpu")) == 4
        engine.clear()
        cleared = engine.drain_events()[1]
        assert lookup(engine, keys) == 0 and {e.digest for e in cleared if e.tier == "disk"} == {k.digest for k in keys}
        assert scan_persisted_digests(engine.config) == set()
    assert safety_net_firings() == fired


def test_a_tier_short_of_room_refuses_the_put_and_counts_it() -> None:
    with CacheEngine(config(max_local_cpu_size=2 * CHUNK_OBJECT_BYTES / 1024**3)) as engine:
        keys = keys_for(engine, TOKENS, NS)[:3]
        fired = safety_net_firings()
        assert [save(engine, key, data_for(key), ("cpu",)) for key in keys] == [True, True, False]
        assert safety_net_firings() == fired + 1 and engine.stats()["cpu_safety_net_full"] == 1
        stored, removed = engine.drain_events()
        assert [e.digest for e in stored] == [k.digest for k in keys[:2]] and removed == []  # nothing evicted
        assert [held_by(engine, k) for k in keys] == ["cpu", "cpu", None]


def test_demotion_is_the_directory_s_eviction_with_a_demote_to(tmp_path: Path) -> None:
    cfg = config(tmp_path, max_local_cpu_size=2 * CHUNK_OBJECT_BYTES / 1024**3, disk_feed="demote")
    fired = safety_net_firings()
    with Directed(cfg, PAYLOAD_BYTES) as d:
        keys = keys_for(d.engine, TOKENS, NS)[:6]
        for key in keys:
            assert d.save(key, data_for(key)) == ("cpu",)  # the disk tier is fed by demotions only
        d.step()
        d.engine.flush()
        assert scan_persisted_digests(cfg) == {k.digest for k in keys[:4]}  # what the directory evicted
        assert d.sources(keys) == ["disk"] * 4 + ["cpu"] * 2
        for key in keys:
            got = d.load(key)
            assert got is not None and torch.equal(got, data_for(key))
        assert d.engine.drain_events()[1] == []  # no tier lost anything on its own
        assert d.held("cpu") == d.planned("cpu")
    assert safety_net_firings() == fired


def test_disk_only_engine(tmp_path: Path) -> None:
    with CacheEngine(config(tmp_path, local_cpu=False)) as engine:
        key = keys_for(engine, TOKENS, NS)[0]
        data = data_for(key)
        assert save(engine, key, data)
        data.zero_()
        engine.flush()
        got = load(engine, key)
        assert got is not None and torch.equal(got, data_for(key))
        out = torch.empty(CHUNK_SHAPE)
        assert load(engine, key, out=out) is out and torch.equal(out, data_for(key))
        keys = keys_for(engine, TOKENS, NS)[1:5]
        for other in keys:
            save(engine, other, data_for(other))
        outs = [torch.empty(CHUNK_SHAPE) for _ in keys]
        results = load_many(engine, keys, outs)
        assert all(r is o and torch.equal(o, data_for(k)) for r, o, k in zip(results, outs, keys))
        assert [torch.equal(r, data_for(k)) for r, k in zip(load_many(engine, keys), keys)] == [True] * 4  # type: ignore[arg-type]


def test_faults_never_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with CacheEngine(config(tmp_path, local_cpu=False)) as engine:
        keys = keys_for(engine, TOKENS, NS)
        save(engine, keys[1], data_for(keys[1]))
        engine.flush()
        path = Path(object_files.object_path(str(tmp_path / "rank0"), keys[1].digest))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x10
        path.write_bytes(bytes(raw))
        assert load(engine, keys[1]) is None  # a flipped byte is a miss, never wrong data
        assert engine.stats()["disk_corrupted_reads"] == 1
        assert [(e.tier, e.digest) for e in engine.drain_events()[1]] == [("disk", keys[1].digest)]

        def boom(*args: object, **kwargs: object) -> None:
            raise RuntimeError("bug")

        save(engine, keys[2], data_for(keys[2]))
        engine.flush()
        monkeypatch.setattr(tier(engine, "disk").reader, "read", boom)
        assert load(engine, keys[2]) is None and engine.stats()["disk_errors_load"] == 1


def test_restart_in_a_new_process_serves_old_entries(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        import torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from engine_verbs import keys_for, save
        from lmi_cache.keys.hashing import KeyNamespace
        from lmi_cache.config.cache_config import CacheConfig
        from lmi_cache.engine import CacheEngine
        ns = KeyNamespace("tiny-llama", "float32", "cpu-lbhnc-v1")
        cfg = CacheConfig(chunk_size=16, local_disk=({str(tmp_path)!r},), max_local_disk_size=1 / 1024)
        with CacheEngine(cfg) as engine:
            for key in keys_for(engine, {TOKENS!r}, ns):
                save(engine, key, torch.arange(256, dtype=torch.float32).reshape(2, 16, 8) + key.start)
            engine.flush()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env=dict(os.environ, PYTHONHASHSEED="7"))
    cfg = config(tmp_path)
    assert len(scan_persisted_digests(cfg)) == len(TOKENS) // 16
    with CacheEngine(cfg) as engine:
        keys = keys_for(engine, TOKENS, NS)
        assert lookup(engine, keys) == len(TOKENS)
        for key in keys:
            got = load(engine, key)
            assert got is not None and torch.equal(got, data_for(key))


def test_saves_never_wait_for_the_disk_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real_write = object_files.write_object_file

    def slow_write(*args: Any, **kwargs: Any) -> int:
        gate.wait(10)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(object_files, "write_object_file", slow_write)
    with Directed(config(tmp_path, max_local_cpu_size=2 * CHUNK_OBJECT_BYTES / 1024**3), PAYLOAD_BYTES) as d:
        engine = d.engine
        keys = keys_for(engine, TOKENS, NS)[:4]
        start = time.perf_counter()
        assert all(d.save(key, data_for(key)) for key in keys)  # never blocks on the writer
        assert time.perf_counter() - start < 2.0
        # Evicted from the CPU tier while their writes wait: the queued write keeps its reference.
        assert [held_by(engine, k) for k in keys] == ["disk", "disk", "cpu", "cpu"]
        got = d.load(keys[0])  # served from the pending write (no file yet)
        assert got is not None and torch.equal(got, data_for(keys[0]))
        gate.set()
        engine.flush()
        for key in keys:
            got = d.load(key)
            assert got is not None and torch.equal(got, data_for(key))


@pytest.mark.parametrize("feed", ["write_through", "demote"])
def test_concurrent_stores_and_loads_never_return_wrong_bytes(tmp_path: Path, feed: str) -> None:
    cfg = config(tmp_path, max_local_cpu_size=4 * CHUNK_OBJECT_BYTES / 1024**3, disk_feed=feed,
                 disk_queue_depth=4)
    errors: list[str] = []
    with CacheEngine(cfg) as engine:
        keys = keys_for(engine, TOKENS, NS)

        def writer(seed: int) -> None:
            for i in range(200):
                key = keys[(i * 7 + seed) % len(keys)]
                save(engine, key, data_for(key))

        def reader(seed: int) -> None:
            out = torch.empty(CHUNK_SHAPE)
            for i in range(200):
                key = keys[(i * 5 + seed) % len(keys)]
                got = load(engine, key, out=out if i % 2 else None)
                if got is not None and not torch.equal(got, data_for(key)):
                    errors.append(f"wrong bytes for chunk at {key.start}")

        threads = [threading.Thread(target=writer, args=(s,)) for s in (0, 3)]
        threads += [threading.Thread(target=reader, args=(s,)) for s in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        engine.flush()
        stats = engine.stats()
        assert stats["cpu_used_bytes"] <= stats["cpu_capacity_bytes"]
        assert stats["disk_used_bytes"] <= stats["disk_capacity_bytes"]
    assert not errors


def test_ranks_sharing_a_path_keep_separate_dirs_and_budgets(tmp_path: Path) -> None:
    cfg = config(tmp_path, local_cpu=False, max_local_disk_size=3 * 4096 / 1024**3)  # 3 chunk files per rank
    ns = [KeyNamespace("tiny-llama", "float32", "cpu-lbhnc-v1", tp_rank=r, tp_size=2) for r in (0, 1)]
    with CacheEngine(cfg, rank_label="0") as rank0, CacheEngine(cfg, rank_label="1") as rank1:
        keys0, keys1 = keys_for(rank0, TOKENS, ns[0])[:3], keys_for(rank1, TOKENS, ns[1])[:3]
        for key in keys0:
            save(rank0, key, data_for(key))
        for key in keys1:
            save(rank1, key, data_for(key))
        rank0.flush()
        rank1.flush()
    assert scan_persisted_digests(cfg) == {k.digest for k in keys0 + keys1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    with CacheEngine(cfg, rank_label="0") as again:  # a restart adopts only its own files
        assert again.stats()["disk_entries"] == 3 and lookup(again, keys0) == keys0[-1].end
        assert lookup(again, keys1) == 0


@pytest.mark.parametrize("local_cpu", [True, False])
def test_save_many_fills_engine_memory_in_place(tmp_path: Path, local_cpu: bool) -> None:
    with CacheEngine(config(tmp_path, local_cpu=local_cpu)) as engine:
        keys = keys_for(engine, TOKENS, NS)
        calls: list[list[torch.Tensor]] = []

        def fill_for(chunk_keys: list[ChunkKey]):  # type: ignore[no-untyped-def]
            def fill(outs: list[torch.Tensor]) -> None:
                assert all(tuple(o.shape) == CHUNK_SHAPE and o.dtype == torch.float32 for o in outs)
                calls.append(outs)
                for out, key in zip(outs, chunk_keys):
                    out.copy_(data_for(key))
            return fill

        names = all_tiers(engine)
        assert engine.save_many(keys[:2], CHUNK_SHAPE, torch.float32, fill_for(keys[:2]), [names] * 2) == [True, True]
        engine.flush()
        assert len(calls) == 1 and len(calls[0]) == 2  # one fill for the whole batch
        for key in keys[:2]:
            got = load(engine, key)
            assert got is not None and torch.equal(got, data_for(key))
        # Planned nowhere (the directory plans no store of a held chunk): not filled; only the new chunk is.
        assert engine.save_many([keys[0], keys[2]], CHUNK_SHAPE, torch.float32, fill_for([keys[2]]),
                                [(), names]) == [False, True]
        assert len(calls) == 2 and len(calls[1]) == 1

        def broken(outs: list[torch.Tensor]) -> None:
            outs[0].fill_(7.0)
            raise RuntimeError("gather failed")

        # A fill that raises is a refused save and leaves no entry behind (never half-written data).
        assert engine.save_many([keys[3]], CHUNK_SHAPE, torch.float32, broken, [names]) == [False]
        engine.flush()
        assert held_by(engine, keys[3]) is None and load(engine, keys[3]) is None
        assert engine.stats()["engine_dropped_error"] == 1
        if local_cpu:  # nothing of the refused chunk is accounted
            assert engine.stats()["cpu_entries"] == 3 and engine.stats()["cpu_used_bytes"] == 3 * CHUNK_OBJECT_BYTES


def test_loads_hand_out_tier_buffers_by_reference_and_recycle_them() -> None:
    with CacheEngine(config()) as engine:
        keys = keys_for(engine, TOKENS, NS)[:2]
        for key in keys:
            save(engine, key, data_for(key))
        cpu = tier(engine, "cpu")
        batches = list(engine.load(keys, ["cpu", "cpu"]))
        assert len(batches) == 1 and [p for p, _ in batches[0]] == [0, 1]  # CPU hits: one batch, at once
        objs = [obj for _, obj in batches[0]]
        held = cpu.peek(keys[0].digest)
        assert held is objs[0] and objs[0].refs == 3  # the tier's buffer itself, one reference for us (and peek)
        held.release()
        cpu.clear()  # evicted while we read: the buffer stays valid until we release it
        assert torch.equal(objs[0].payload_tensor(), data_for(keys[0]))
        pooled = engine.allocator.pooled_bytes
        for obj in objs:
            obj.release()
        assert engine.allocator.pooled_bytes == pooled + 2 * CHUNK_OBJECT_BYTES  # back to the warm pool


def test_huge_page_entries_round_trip_through_odirect_disk(tmp_path: Path) -> None:
    # A 4 MiB chunk takes the huge-page allocation path; write-through must still O_DIRECT it to disk.
    cfg = CacheConfig(chunk_size=16, max_local_cpu_size=0.05, local_disk=(str(tmp_path),),
                      max_local_disk_size=0.05, use_odirect=True)
    key = chunk_keys_for_big()
    data = torch.randn(8, 2, 4, 128, 128)  # 4 MiB of float32
    with CacheEngine(cfg) as engine:
        assert save(engine, key, data)
        got = load(engine, key)
        assert got is not None and torch.equal(got, data)
        engine.flush()
    with CacheEngine(cfg) as engine:  # a fresh engine sees only the disk
        assert held_by(engine, key) == "disk"
        got = load(engine, key)
        assert got is not None and torch.equal(got, data)


def chunk_keys_for_big() -> ChunkKey:
    from lmi_cache.keys.hashing import chunk_keys

    return chunk_keys(list(range(16)), NS, 16)[0]


def test_restart_over_a_shrunken_disk_budget_is_trimmed_by_the_directory(tmp_path: Path) -> None:
    # The disk tier adopts every file it finds; the directory adopts them oldest first and evicts the excess.
    with CacheEngine(config(tmp_path, local_cpu=False)) as engine:
        keys = keys_for(engine, TOKENS, NS)[:4]
        for key in keys:
            save(engine, key, data_for(key))
            engine.flush()
            time.sleep(0.01)  # distinct mtimes: the oldest file is the first chunk
    file_bytes = next(tmp_path.rglob("*.lmc")).stat().st_size
    with Directed(config(tmp_path, max_local_disk_size=2.5 * file_bytes / 1024**3), PAYLOAD_BYTES) as d:
        assert d.engine.stats()["disk_entries"] == 4  # the store itself never trims
        d.step()  # the directory's evictions of the oldest files reach the tier
        assert d.engine.stats()["disk_entries"] == 2 and d.engine.drain_events()[1] == []
        assert d.sources(keys) == [None, None, "disk", "disk"] and d.held("disk") == d.planned("disk")
        got = d.load(keys[2])
        assert got is not None and torch.equal(got, data_for(keys[2]))
    assert len(list(tmp_path.rglob("*.lmc"))) == 2


def test_directed_verbs_store_read_and_evict_where_the_directory_says(tmp_path: Path) -> None:
    """The placement directory names tiers: a store goes only there, a load asks only its source tier,
    a promotion happens only when asked, and an eviction (with demotion) drops what it names."""
    fill_one = lambda key: (lambda outs: outs[0].copy_(data_for(key)))  # noqa: E731
    with CacheEngine(config(tmp_path)) as engine:
        a, b, c = keys_for(engine, TOKENS, NS)[:3]
        assert engine.save_many([a], CHUNK_SHAPE, torch.float32, fill_one(a), [("disk",)]) == [True]
        engine.flush()
        assert held_by(engine, a) == "disk"
        assert engine.save_many([b], CHUNK_SHAPE, torch.float32, fill_one(b), [()]) == [False]  # nowhere: not stored
        stored, _ = engine.drain_events()
        assert [(e.tier, e.digest, e.payload_bytes) for e in stored] == [("disk", a.digest, 1024)]
        # Asked of the CPU tier only, a chunk on disk is a miss; asked of the disk, a hit, not promoted.
        assert list(engine.load([a], ["cpu"], [False])) == []
        hits = [obj for batch in engine.load([a], ["disk"], [False]) for _, obj in batch]
        assert len(hits) == 1 and torch.equal(hits[0].payload_tensor().view(CHUNK_SHAPE), data_for(a))
        hits[0].release()
        assert held_by(engine, a) == "disk"
        for _, obj in [item for batch in engine.load([a], ["disk"], [True]) for item in batch]:
            obj.release()
        assert tier(engine, "cpu").contains(a.digest)  # promoted because it was asked to be
        # An eviction drops only the named tier; with a demotion the chunk moves to the next one first.
        assert save(engine, c, data_for(c)) and engine.flush() is None
        engine.evict("cpu", a.digest)
        assert not tier(engine, "cpu").contains(a.digest) and tier(engine, "disk").contains(a.digest)
        engine.evict("disk", c.digest)
        assert held_by(engine, c) == "cpu"
        engine.evict("cpu", c.digest, demote_to="disk")
        engine.flush()
        assert held_by(engine, c) == "disk"
        got = load(engine, c)
        assert got is not None and torch.equal(got, data_for(c))
        assert all(e.tier != "cpu" for e in engine.drain_events()[1])  # instructed evictions are not news
