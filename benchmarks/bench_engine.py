"""Micro-benchmark of the cache engine: every figure is a ratio against a baseline measured in the same run.

Run: ``.venv/bin/python benchmarks/bench_engine.py`` (about a minute; ``--quick`` for a smoke run; ``--help``).
It drives the engine through its serving verbs only (``save_many``, ``load``,
the tiers' ``put`` / ``get_many``), the way the vLLM connector does. Ratios are
the median over rounds of (baseline time / our time), each round's pair run
back to back so a busy host hits both sides; GB/s are each side's best round.

- Hashing throughput (tokens/s); the worker's held-check and the scheduler's
  lookup (key-space hash + its digest index) for a 128k-token prompt.
- CPU tier: ``save_many`` (one connector step of chunks at a time, tier full
  and evicting) vs a plain copy of the same bytes; ``load`` hands out
  references (no copy), so it is measured as "load + copy out" (what the
  connector's scatter does) vs the same plain copy (target >= 0.7). The
  baseline is the fastest of torch's and numpy's copy, between plain tensors
  and between a tensor and host-allocator memory (huge pages where allowed).
- Disk tier write / read vs raw sequential write / read of the same bytes on
  the same filesystem (target >= 0.7), buffered and with O_DIRECT. Cold reads
  drop each file from the page cache first (fsync + POSIX_FADV_DONTNEED, both
  sides). ``load(keys)`` of a whole prefix runs its reads in parallel.
- CPU-to-disk feeding: write-through vs demote-on-evict (caller cost, disk
  bytes written, what survives a restart).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmi_cache.keys.chunk_format import HEADER_BYTES, ChunkHeader
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, KeySpace, chunk_keys
from lmi_cache.config.cache_config import CacheConfig
from lmi_cache.engine import CacheEngine
from lmi_cache.tiers.disk import object_files
from lmi_cache.tiers.base import Tier
from lmi_cache.tiers.buffers import size_class_bytes
from lmi_cache.tiers.disk.ranks import rank_disk_dirs
from lmi_cache.tiers.disk.tier import DiskTier
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator

NS = KeyNamespace("bench-model", "bfloat16", "bench-v1")
GIB = 1024**3
CHUNK_TOKENS = 256


def interleaved_times(repeats: int, fns: list[Callable[[], object]]) -> list[list[float]]:
    """Seconds of each fn per round, rounds interleaved so load swings on a shared host hit every side."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return times


def round_min(*sides: list[float]) -> list[float]:
    """Per round, the fastest of several baselines."""
    return [min(values) for values in zip(*sides)]


def line(name: str, value: str, note: str = "") -> None:
    print(f"  {name:<50} {value:>14}  {note}")


def ratio_line(name: str, ours_s: list[float], base_s: list[float], num_bytes: int) -> None:
    """Median over rounds of base/ours (each round's pair ran back to back, so host load mostly cancels),
    with the best round's throughput of each side."""
    ratio = statistics.median(b / o for b, o in zip(base_s, ours_s))
    line(name, f"{ratio:.2f}x", f"({num_bytes / min(ours_s) / 1e9:.2f} vs {num_bytes / min(base_s) / 1e9:.2f} GB/s)")


def make_keys(count: int, salt: int = 0) -> list[ChunkKey]:
    tokens = np.random.default_rng(salt).integers(0, 150_000, count * CHUNK_TOKENS).tolist()
    return chunk_keys(tokens, NS, CHUNK_TOKENS)


def np_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    return dst


def tier_named(engine: CacheEngine, name: str) -> Tier:
    return next(tier for tier in engine.tiers if tier.name == name)


def save_steps(engine: CacheEngine, keys: Sequence[ChunkKey], sources: Sequence[torch.Tensor], step: int) -> None:
    """``save_many`` one connector step (``step`` chunks) at a time; ``fill`` copies the sources in."""
    for first in range(0, len(keys), step):
        batch = sources[first : first + step]

        def fill(outs: list[torch.Tensor], batch: Sequence[torch.Tensor] = batch) -> None:
            for out, source in zip(outs, batch):
                np_copy(out, source)

        names = tuple(tier.name if tier.local else "remote" for tier in engine.tiers)  # an offline tool: every tier
        if not all(engine.save_many(keys[first : first + step], tuple(batch[0].shape), batch[0].dtype, fill,
                                    [names] * len(batch))):
            raise RuntimeError("save refused")


def load_into(engine: CacheEngine, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor] | None) -> int:
    """``load(keys)`` as the connector uses it: copy each hit out (into ``outs[pos % len]``), then release."""
    hits = 0
    # An offline tool names the sources itself: the first local tier holding each chunk.
    sources = [next((t.name for t in engine.tiers if t.local and t.contains(k.digest)), "remote") for k in keys]
    for batch in engine.load(keys, sources):
        for position, obj in batch:
            try:
                if outs:
                    np_copy(outs[position % len(outs)], obj.payload_tensor())
            finally:
                obj.release()
            hits += 1
    if hits != len(keys):
        raise RuntimeError(f"{len(keys) - hits} misses")
    return hits


# ------------------------------------------------------------ hashing and lookup
def bench_hashing(repeats: int) -> None:
    print(f"hashing and lookup (128k-token prompt, chunk {CHUNK_TOKENS})")
    tokens = np.random.default_rng(1).integers(0, 150_000, 131_072).tolist()
    space = KeySpace("bench-model", "bfloat16", "bench.layout", CHUNK_TOKENS)
    keys = space.keys(tokens, 0)
    small = torch.zeros(16, dtype=torch.uint8)
    with CacheEngine(CacheConfig(chunk_size=CHUNK_TOKENS, max_local_cpu_size=0.01)) as engine:
        save_steps(engine, keys, [small] * len(keys), 64)
        held = {event.digest for event in engine.drain_events()[0]}  # what the placement directory is told
        local = [tier for tier in engine.tiers if tier.local]

        def held_check() -> int:  # the worker's "already held?" check of save_many, per key
            return sum(any(tier.contains(key.digest) for tier in local) for key in keys)

        def scheduler_lookup() -> int:  # hash the prompt once, then the leading chunks the directory holds
            hits = 0
            for per_rank in space.for_request(tokens).per_chunk:
                if not all(key.digest in held for key in per_rank):
                    break
                hits += 1
            return hits

        hash_s, check_s, lookup_s = (min(t) for t in interleaved_times(repeats * 3, [
            lambda: chunk_keys(tokens, NS, CHUNK_TOKENS), held_check, scheduler_lookup]))
        assert held_check() == len(keys) and scheduler_lookup() == len(keys)
    line("hash 128k tokens (xxh3-128 chain)", f"{hash_s * 1e3:.2f} ms", f"({len(tokens) / hash_s / 1e6:.1f} M tokens/s)")
    line(f"worker held-check, {len(keys)} keys (all hits)", f"{check_s * 1e3:.2f} ms")
    line("scheduler lookup 128k (key-space hash + index)", f"{lookup_s * 1e3:.2f} ms")


# ------------------------------------------------------------ CPU tier
def bench_cpu(chunk_bytes: int, num_chunks: int, step: int, repeats: int) -> None:
    print(f"CPU tier ({num_chunks} chunks of {chunk_bytes / 2**20:.1f} MiB, save_many {step} per step, "
          "tier full and evicting)")
    keys = make_keys(num_chunks * 2, salt=2)
    sources = [torch.randn(chunk_bytes // 2).to(torch.bfloat16) for _ in range(num_chunks)]
    destinations = [torch.empty_like(s) for s in sources]
    # The engine's side of each copy is host-allocator memory (huge pages where the kernel allows),
    # so the baselines also copy into / out of such buffers, at the payload's offset: same bytes, same memory.
    allocator = HostAllocator(page_locked=False, pool_limit_bytes=0)
    class_bytes = size_class_bytes(HEADER_BYTES + chunk_bytes)
    host = [allocator.allocate(class_bytes) for _ in sources]
    host_payloads = [b[HEADER_BYTES : HEADER_BYTES + chunk_bytes] for b in host if b is not None]
    for payload, source in zip(host_payloads, sources):
        np_copy(payload, source)
    total = chunk_bytes * num_chunks * 2  # every timed function handles two rounds
    with CacheEngine(CacheConfig(max_local_cpu_size=num_chunks * class_bytes / GIB)) as engine:  # holds one round
        round_number = [0]

        def save_round() -> None:
            offset = num_chunks * (round_number[0] % 2)  # alternate key sets: every save evicts
            round_number[0] += 1
            save_steps(engine, keys[offset : offset + num_chunks], sources, step)

        def save_two_rounds() -> None:
            save_round()
            save_round()

        save_round()  # warm-up: first-touch allocations
        save_round()
        live = keys[num_chunks * ((round_number[0] - 1) % 2) :][:num_chunks]  # written by the last round
        # Baselines: the fastest of torch's copy and numpy's memcpy (torch's OpenMP copy stalls when
        # another process holds a core; the fill and copy-out here use numpy's), between plain tensors
        # and between a tensor and host-allocator memory, per round.
        timings = interleaved_times(repeats, [
            save_two_rounds,
            lambda: [load_into(engine, live, destinations) for _ in range(2)],
            lambda: [load_into(engine, live, None) for _ in range(2)],
            lambda: [[d.copy_(s) for d, s in zip(destinations, sources)] for _ in range(2)],
            lambda: [[np_copy(d, s) for d, s in zip(destinations, sources)] for _ in range(2)],
            lambda: [[np_copy(h, s) for h, s in zip(host_payloads, sources)] for _ in range(2)],
            lambda: [[np_copy(d, h) for d, h in zip(destinations, host_payloads)] for _ in range(2)],
            lambda: [[s.clone() for s in sources] for _ in range(2)],
            lambda: [[np_copy(torch.empty_like(s), s) for s in sources] for _ in range(2)],
        ])
        save_s, load_copy_s, load_ref_s, copy_torch_s, copy_np_s, into_host_s, out_of_host_s = timings[:7]
        clone_s = round_min(*timings[7:])
        for d in destinations:
            d.zero_()
        load_into(engine, live, destinations)
        assert all(torch.equal(d, s) for d, s in zip(destinations, sources))
    ratio_line("save_many vs copy into a warm buffer", save_s, round_min(copy_torch_s, copy_np_s, into_host_s), total)
    ratio_line("save_many vs clone()", save_s, clone_s, total)
    ratio_line("load + copy out vs copy out of a warm buffer", load_copy_s,
               round_min(copy_torch_s, copy_np_s, out_of_host_s), total)
    line("load alone (references, no copy) per chunk", f"{min(load_ref_s) / (2 * num_chunks) * 1e6:.1f} us")


# ------------------------------------------------------------ disk tier
def _drop_file_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _flags(odirect: bool) -> int:
    return getattr(os, "O_DIRECT", 0) if odirect else 0


def _raw_write(path: str, source: np.ndarray, num_chunks: int, odirect: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _flags(odirect), 0o600)
    try:
        view = source.data
        for _ in range(num_chunks):
            offset = 0
            while offset < len(view):
                offset += os.write(fd, view[offset:])
    finally:
        os.close(fd)


def _raw_read(path: str, buffer: np.ndarray, num_chunks: int, odirect: bool) -> None:
    fd = os.open(path, os.O_RDONLY | _flags(odirect))
    try:
        view = buffer.data
        for i in range(num_chunks):
            os.preadv(fd, [view], i * len(view))
    finally:
        os.close(fd)


def _raw_read_files(paths: list[str], buffer: np.ndarray, odirect: bool) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY | _flags(odirect))
        try:
            os.preadv(fd, [buffer.data], 0)
        finally:
            os.close(fd)


def _raw_write_files(root: str, objects: list[ChunkObject], odirect: bool) -> None:
    """The tier's file layout without the engine: create a temp file, write the object, rename."""
    for obj in objects:
        path = object_files.object_path(root, obj.key.digest)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        size = object_files.round_up(obj.header.total_bytes) if odirect else obj.header.total_bytes
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _flags(odirect), 0o600)
        try:
            os.write(fd, obj.buffer.numpy()[:size].data)
        finally:
            os.close(fd)
        os.replace(path + ".tmp", path)


def _odirect_works(root: Path) -> bool:
    try:
        fd = os.open(root / "probe", os.O_WRONLY | os.O_CREAT | _flags(True), 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(root / "probe")
    return hasattr(os, "O_DIRECT")


def _release_all(tier: Tier, keys: Sequence[ChunkKey], read_one: Callable[[ChunkKey], ChunkObject | None] | None) -> None:
    """Tier reads without a copy: one by one through ``read_one``, or all through ``get_many`` (parallel)."""
    hits = 0
    if read_one is not None:
        for key in keys:
            obj = read_one(key)
            if obj is not None:
                obj.release()
                hits += 1
    else:
        for batch in tier.get_many(keys):
            for _, obj in batch:
                obj.release()
                hits += 1
    if hits != len(keys):
        raise RuntimeError("disk miss")


def bench_disk(root: Path, chunk_bytes: int, num_chunks: int, step: int, odirect: bool, repeats: int) -> None:
    label = "O_DIRECT" if odirect else "buffered"
    if odirect and not _odirect_works(root):
        print(f"disk tier, {label}: this filesystem refuses O_DIRECT; section skipped")
        return
    tier_dir = root / f"tier-{label}"
    total = chunk_bytes * num_chunks
    config = CacheConfig(local_cpu=False, local_disk=(str(tier_dir),), max_local_disk_size=2 * total / GIB,
                         use_odirect=odirect, disk_queue_depth=max(num_chunks, 1))
    print(f"disk tier, {label} ({num_chunks} chunks of {chunk_bytes / 2**20:.1f} MiB in {root}, "
          f"{config.disk_read_workers} read workers, {repeats} rounds)")
    raw_path = str(root / "raw.bin")
    source = object_files.aligned_buffer(chunk_bytes)
    source[:] = np.random.default_rng(3).integers(0, 256, chunk_bytes, dtype=np.uint8)
    source_tensor = torch.from_numpy(source)
    read_buffer = object_files.aligned_buffer(chunk_bytes + HEADER_BYTES)
    keys = make_keys(num_chunks, salt=4 + odirect)
    files = [object_files.object_path(rank_disk_dirs(config.local_disk, "0")[0], k.digest) for k in keys]
    # What save_many hands the tiers: page-aligned chunk objects from the host allocator.
    allocator = HostAllocator(page_locked=False, pool_limit_bytes=0)
    objects = []
    for key in keys:
        obj = allocator.new_object(key, ChunkHeader.for_key(key, chunk_bytes, "uint8", (chunk_bytes,)))
        assert obj is not None
        obj.payload_array()[:] = source
        objects.append(obj)
    outs = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(8)]  # warm destinations of the copy-out
    rounds: dict[str, list[float]] = defaultdict(list)  # seconds per round, by figure

    def timed(name: str, fn: Callable[[], object], cold_files: list[str] | None = None) -> None:
        if cold_files:
            _drop_file_cache(cold_files)
        start = time.perf_counter()
        fn()
        rounds[name].append(time.perf_counter() - start)

    def write_all(target: Tier) -> None:
        for obj in objects:
            if not target.put(obj):  # the tier takes its own reference until the file is written
                raise RuntimeError("disk put dropped")
        target.flush(120)

    def save_and_flush() -> None:
        save_steps(engine, keys, [source_tensor] * num_chunks, step)
        engine.flush(120)

    with CacheEngine(config) as engine:
        tier = tier_named(engine, "disk")
        assert isinstance(tier, DiskTier)
        reader = tier.reader
        for _ in range(repeats):  # interleaved, so load swings on a shared host hit every side
            timed("raw_write", lambda: _raw_write(raw_path, source, num_chunks, odirect))
            timed("raw_read", lambda: _raw_read(raw_path, read_buffer[:chunk_bytes], num_chunks, odirect), [raw_path])
            os.unlink(raw_path)
            timed("raw_files_write", lambda: _raw_write_files(str(root / "raw-files"), objects, odirect))
            shutil.rmtree(root / "raw-files")
            engine.clear()
            timed("write", lambda: write_all(tier))
            timed("raw_files_read", lambda: _raw_read_files(files, read_buffer, odirect), files)
            timed("read_one", lambda: _release_all(tier, keys, reader.read), files)
            timed("get_many", lambda: _release_all(tier, keys, None), files)
            timed("load", lambda: load_into(engine, keys, outs), files)
            timed("load_one", lambda: [load_into(engine, [k], outs) for k in keys], files)
            engine.clear()
            timed("save", save_and_flush)
            engine.clear()
    if not odirect:  # what durability per file would cost (the default relies on checksums instead)
        with CacheEngine(dataclasses.replace(config, disk_fsync=True)) as synced:
            synced_tier = tier_named(synced, "disk")
            for _ in range(repeats):
                timed("write_fsync", lambda: write_all(synced_tier))
                synced.clear()
    for obj in objects:
        obj.release()
    shutil.rmtree(tier_dir)
    ratio_line("tier write (put..flush) vs raw, one big file", rounds["write"], rounds["raw_write"], total)
    ratio_line("tier write (put..flush) vs raw, same files", rounds["write"], rounds["raw_files_write"], total)
    ratio_line("tier read one by one vs raw, one big file", rounds["read_one"], rounds["raw_read"], total)
    ratio_line("tier read one by one vs raw, same files", rounds["read_one"], rounds["raw_files_read"], total)
    ratio_line("tier get_many (parallel) vs raw, same files", rounds["get_many"], rounds["raw_files_read"], total)
    ratio_line("engine load(keys) + copy out vs raw, big file", rounds["load"], rounds["raw_read"], total)
    ratio_line("engine load(keys) + copy out vs raw, same files", rounds["load"], rounds["raw_files_read"], total)
    ratio_line("engine load one key at a time + copy vs raw, big", rounds["load_one"], rounds["raw_read"], total)
    ratio_line("engine save_many..flush (+fill copy) vs raw, big", rounds["save"], rounds["raw_write"], total)
    if "write_fsync" in rounds:
        ratio_line("tier write with fsync per file vs without", rounds["write_fsync"], rounds["write"], total)


# ------------------------------------------------------------ feeding
def _feed_once(config: CacheConfig, keys: list[ChunkKey], source: torch.Tensor, step: int) -> tuple[float, float, float, int]:
    """(caller seconds, seconds until on disk, disk bytes written, leading chunks served after a restart)."""
    with CacheEngine(config) as engine:
        start = time.perf_counter()
        save_steps(engine, keys, [source] * len(keys), step)
        caller_s = time.perf_counter() - start
        engine.flush(120)
        total_s = time.perf_counter() - start
        written = engine.stats().get("disk_stored_bytes", 0)
    with CacheEngine(config) as restarted:
        disk = tier_named(restarted, "disk")
        survived = next((i for i, k in enumerate(keys) if not disk.contains(k.digest)), len(keys))
    shutil.rmtree(config.local_disk[0])
    return caller_s, total_s, written, survived


def bench_feed(root: Path, chunk_bytes: int, num_chunks: int, step: int, repeats: int) -> None:
    cpu_chunks = max(num_chunks // 4, 1)
    print(f"CPU-to-disk feeding (CPU holds {cpu_chunks} chunks, {num_chunks} saved {step} per step, then a restart; "
          f"median of {repeats})")
    source = torch.randn(chunk_bytes // 2).to(torch.bfloat16)
    keys = make_keys(num_chunks, salt=6)
    feeds = ("write_through", "demote")
    results: dict[str, list[tuple[float, float, float, int]]] = {feed: [] for feed in feeds}
    for _ in range(repeats):  # interleaved, so load swings on a shared host hit both
        for feed in feeds:
            config = CacheConfig(max_local_cpu_size=cpu_chunks * size_class_bytes(HEADER_BYTES + chunk_bytes) / GIB,
                                 local_disk=(str(root / f"feed-{feed}"),),
                                 max_local_disk_size=4 * num_chunks * chunk_bytes / GIB,
                                 disk_feed=feed, disk_queue_depth=max(num_chunks, 1))
            results[feed].append(_feed_once(config, keys, source, step))
    for feed in feeds:
        caller_s, total_s, written, survived = (statistics.median(column) for column in zip(*results[feed]))
        line(f"{feed}: save_many per chunk (caller)", f"{caller_s / num_chunks * 1e3:.2f} ms",
             f"(until on disk: {total_s:.2f} s)")
        line(f"{feed}: disk bytes written", f"{written / 2**20:.0f} MiB",
             f"(prefix served after restart: {survived:.0f}/{num_chunks} chunks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="filesystem for the disk figures (default: a temp dir)")
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="chunk payload size (default 4 MiB)")
    parser.add_argument("--num-chunks", type=int, default=32)
    parser.add_argument("--step-chunks", type=int, default=8, help="chunks per save_many call (one connector step)")
    parser.add_argument("--repeats", type=int, default=10, help="rounds of the in-memory figures")
    parser.add_argument("--disk-repeats", type=int, default=5, help="rounds of the disk figures")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 chunks of 1 MiB, one round each")
    args = parser.parse_args()
    if args.quick:
        args.chunk_mib, args.num_chunks, args.step_chunks, args.repeats, args.disk_repeats = 1.0, 8, 4, 1, 1
    chunk_bytes = int(args.chunk_mib * 2**20) // 4096 * 4096
    if chunk_bytes <= 0 or args.num_chunks < 1 or args.step_chunks < 1 or args.repeats < 1 or args.disk_repeats < 1:
        parser.error("--chunk-mib must be at least 4 KiB, counts at least 1")
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir}: not a directory")
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="lmi-bench-", dir=args.dir))
    print(f"lmi_cache engine benchmark: torch {torch.__version__}, {os.cpu_count()} CPUs, threads={torch.get_num_threads()}")
    started = time.perf_counter()
    try:
        bench_hashing(args.repeats)
        bench_cpu(chunk_bytes, args.num_chunks, args.step_chunks, args.repeats)
        bench_disk(root, chunk_bytes, args.num_chunks, args.step_chunks, odirect=False, repeats=args.disk_repeats)
        bench_disk(root, chunk_bytes, args.num_chunks, args.step_chunks, odirect=True, repeats=args.disk_repeats)
        bench_feed(root, chunk_bytes, args.num_chunks, args.step_chunks, args.disk_repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
