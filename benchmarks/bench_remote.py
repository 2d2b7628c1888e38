"""Remote tier benchmark: every figure is a ratio against a baseline measured in the same run.

Run: ``.venv/bin/python benchmarks/bench_remote.py`` (about 1-2 min; needs
``redis-server`` on PATH; ``--help``). It starts its own redis-server on a free
loopback port and stops it at the end.

1. Retrieve throughput: ``RemoteCache.read_many_into`` as the remote tier calls it
   (one MGET per batch, each reply received straight into pooled host buffers, every
   value verified: value header, chunk header, fingerprint, XXH3 payload
   checksum; with ``--mac`` rows also the BLAKE3 MAC) against a plain GET loop
   of the same values with the same redis-py client (target >= 0.9), and against
   a plain MGET of the same batch.
2. Compression on real KV: the tiny Llama models (random weights,
   ``lmi_cache.devtools.tiny_model``) run forward in transformers on CPU over
   Python source text; their past_key_values, in bfloat16 and float32, are cut
   into 256-token chunk objects. For each codec: ratio, encode and decode
   speed (CPU time of one core), and the link speed below which compression
   makes a remote load faster (raw/link > compressed/link + decode time).
3. Integrity checks per core: the XXH3 payload checksum, the BLAKE3 keyed MAC
   and HMAC-SHA256 (the MAC not chosen), in thread CPU time.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmi_cache.keys.chunk_format import ChunkHeader, unpack_header  # noqa: E402
from lmi_cache.keys.hashing import ChunkKey, KeyNamespace, chunk_keys  # noqa: E402
from lmi_cache.remote import RemoteSettings, open_remote  # noqa: E402
from lmi_cache.devtools.redis_server import RedisServer  # noqa: E402
from lmi_cache.remote.redis_store import RedisStore  # noqa: E402
from lmi_cache.remote.value_codec import DecodedChunk, ValueCodec  # noqa: E402
from lmi_cache.tiers.host_memory import HostAllocator  # noqa: E402

MIB = 1 << 20
SECRET = b"benchmark-secret-0123456789abcdef"


def interleaved_best(repeats: int, fns: list[Callable[[], object]],
                     clock: Callable[[], float] = time.perf_counter) -> list[float]:
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
    return best


def process_cpu() -> tuple[float, int]:
    """(user + system CPU seconds, minor page faults) of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def wall_and_cpu(repeats: int, fns: list[Callable[[], object]]
                 ) -> tuple[list[list[float]], list[list[float]], list[list[int]]]:
    """Wall seconds, process-CPU seconds and minor faults of each fn per round, run interleaved (paired)."""
    walls: list[list[float]] = [[] for _ in fns]
    cpus: list[list[float]] = [[] for _ in fns]
    faults: list[list[int]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            wall, (cpu, flt) = time.perf_counter(), process_cpu()
            fn()
            walls[i].append(time.perf_counter() - wall)
            cpu_after, flt_after = process_cpu()
            cpus[i].append(cpu_after - cpu)
            faults[i].append(flt_after - flt)
    return walls, cpus, faults


def paired_ratio(base: list[float], ours: list[float]) -> float:
    """Median over rounds of base/ours: each round's pair ran back to back, so host load cancels."""
    return statistics.median(b / o for b, o in zip(base, ours))


def kv_like_objects(keys: list[ChunkKey], size_bytes: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    objs = []
    for key in keys:
        values = rng.normal(0, 1, size_bytes // 2).astype(np.float32)
        payload = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        header = ChunkHeader.for_key(key, len(payload), "bfloat16", (len(payload) // 2,)).with_checksum(payload)
        objs.append(header.pack() + payload)
    return objs


# ------------------------------------------------------------ 1. retrieve throughput
def bench_retrieve(args: argparse.Namespace) -> None:
    from redis.utils import HIREDIS_AVAILABLE

    parser = "hiredis" if HIREDIS_AVAILABLE else "pure Python (pip install hiredis)"
    print("## Remote retrieve vs a plain GET loop (same values, same redis-py client, loopback redis-server)\n")
    print(f"redis-py reply parser: {parser}\n")
    print("GiB/s: best round. Ratios: median over rounds of (baseline time / read_many time), each round's")
    print("pair run back to back. CPU: user+system seconds of this process per GiB (median); faults: minor")
    print("page faults of this process per GiB (median).\n")
    print("| value | batch | mode | GET loop GiB/s | MGET GiB/s | read_many GiB/s | read_many vs GET loop | "
          "vs MGET | CPU s/GiB GET loop | CPU s/GiB read_many | CPU ratio | faults/GiB GET loop | read_many |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with RedisServer() as server:
        for size_mib in args.sizes_mib:
            num = max(args.batch, int(args.total_mib // size_mib))
            keys = chunk_keys(list(range(num * 256)), KeyNamespace(f"bench-{size_mib}", "bfloat16", "b"), 256)
            objs = kv_like_objects(keys, int(size_mib * MIB))
            for mode, secret in (("verified", None), ("verified+MAC", SECRET)):
                if mode.endswith("MAC") and not args.mac:
                    continue
                settings = RemoteSettings(server.url, key_prefix=f"bench{size_mib}{mode}", io_timeout_ms=30000,
                                          put_queue_bytes=1 << 34)
                cache = open_remote(settings, secret=secret)
                for key, obj in zip(keys, objs):
                    cache.write(key, obj)
                assert cache.flush(120)
                store = cache.store
                assert isinstance(store, RedisStore)
                client = store._client(lookup=False)
                names = [store.name_for(k.digest) for k in keys]
                batches = [keys[i : i + args.batch] for i in range(0, num, args.batch)]
                name_batches = [names[i : i + args.batch] for i in range(0, num, args.batch)]

                def plain_get_loop() -> None:
                    for name in names:
                        assert client.get(name) is not None

                def plain_mget() -> None:
                    for batch in name_batches:
                        client.mget(batch)

                allocator = HostAllocator(page_locked=False)

                def host_memory(num_bytes: int) -> tuple[torch.Tensor, memoryview] | None:
                    buffer = allocator.allocate(num_bytes)
                    return None if buffer is None else (buffer, memoryview(buffer.numpy()))

                def ours() -> None:  # as the remote tier reads: into pooled host buffers, freed after use
                    for batch in batches:
                        for result, owner in cache.read_many_into(batch, host_memory):
                            assert isinstance(result, DecodedChunk)
                            allocator.recycle(owner)

                (w_get, w_mget, w_ours), (c_get, c_mget, c_ours), (f_get, _, f_ours) = wall_and_cpu(
                    args.repeats, [plain_get_loop, plain_mget, ours])
                gib = num * size_mib / 1024
                print(f"| {size_mib:g} MiB | {args.batch} | {mode} | {gib / min(w_get):.2f} | {gib / min(w_mget):.2f} "
                      f"| {gib / min(w_ours):.2f} | **{paired_ratio(w_get, w_ours):.2f}x** | "
                      f"{paired_ratio(w_mget, w_ours):.2f}x | {statistics.median(c_get) / gib:.3f} | "
                      f"{statistics.median(c_ours) / gib:.3f} | {paired_ratio(c_get, c_ours):.2f}x | "
                      f"{statistics.median(f_get) / gib:.0f} | {statistics.median(f_ours) / gib:.0f} |")
                client.delete(*names)
                cache.close()
    print()


# ------------------------------------------------------------ 2. compression on real KV
def tiny_model_chunks(size: str, dtype_name: str, num_tokens: int, chunk_tokens: int) -> list[bytes]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    from lmi_cache.devtools.tiny_model import make_tiny_model

    model_dir = make_tiny_model(Path(tempfile.gettempdir()) / f"lmi-cache-tiny-{size}", size)
    dtype = getattr(torch, dtype_name)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    text = (Path(sysconfig.get_paths()["stdlib"]) / "typing.py").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :num_tokens]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = [(cache.layers[i].keys, cache.layers[i].values) for i in range(len(cache.layers))]
    # [layer, k/v, token, head, dim], the chunk layout of the CPU tier
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in layers]).permute(0, 1, 3, 2, 4).contiguous()
    keys = chunk_keys(ids[0].tolist(), KeyNamespace(size, dtype_name, "bench"), chunk_tokens)
    objs = []
    for key in keys:
        part = kv[:, :, key.start : key.end].contiguous()
        payload = part.view(torch.uint8).numpy().tobytes()
        header = ChunkHeader.for_key(key, len(payload), dtype_name, tuple(part.shape)).with_checksum(payload)
        objs.append(header.pack() + payload)
    return objs


def bench_compression(args: argparse.Namespace) -> None:
    print("## Lossless compression of real KV (tiny Llama models, random weights; 256-token chunks)\n")
    print("Speeds are MB of chunk per CPU-second of one core (thread CPU time).\n")
    print("| model | KV dtype | codec | ratio | encode MB/s | decode MB/s | pays below (Gb/s link) |")
    print("|---|---|---|---|---|---|---|")
    for size in args.models:
        for dtype_name in ("bfloat16", "float32"):
            objs = tiny_model_chunks(size, dtype_name, args.tokens, 256)
            keys = [ChunkKey(h.digest, h.start, h.end, h.fingerprint) for h in (unpack_header(o) for o in objs)]
            raw_bytes = sum(len(o) for o in objs)
            base = ValueCodec(None, "off")
            plain = [base.encode(o) for o in objs]
            cpu = time.thread_time  # codec work is single-threaded CPU: time it so, robust to a busy host
            t_plain_dec = interleaved_best(args.repeats, [lambda: [base.decode(v, k) for v, k in zip(plain, keys)]],
                                           cpu)[0]
            for codec_name in ("off", "zstd", "zstd-planes"):
                for level in ((1, 3) if codec_name != "off" else (1,)):
                    codec = ValueCodec(None, codec_name, zstd_level=level)
                    values: list[bytes] = []

                    def enc() -> None:
                        values[:] = [codec.encode(o) for o in objs]

                    def dec() -> None:
                        for v, k in zip(values, keys):
                            assert isinstance(codec.decode(v, k), DecodedChunk)

                    t_enc, t_dec = interleaved_best(args.repeats, [enc, dec], cpu)
                    stored = sum(len(v) for v in values)
                    ratio = raw_bytes / stored
                    extra_decode_s = max(t_dec - t_plain_dec, 1e-9)
                    # compressed wins when (raw - stored) / link > extra decode time
                    pays_gbps = (raw_bytes - stored) * 8 / extra_decode_s / 1e9 if stored < raw_bytes else 0.0
                    label = codec_name if codec_name == "off" else f"{codec_name} (level {level})"
                    pays = "-" if codec_name == "off" else f"{pays_gbps:.1f}"
                    print(f"| {size} | {dtype_name} | {label} | {ratio:.3f} | {raw_bytes / t_enc / 1e6:.0f} | "
                          f"{raw_bytes / t_dec / 1e6:.0f} | {pays} |")
    print()


# ------------------------------------------------------------ 3. integrity costs
def bench_integrity(args: argparse.Namespace) -> None:
    import hashlib
    import hmac

    import blake3
    import xxhash

    data = np.random.default_rng(0).integers(0, 256, 32 * MIB, dtype=np.uint8).tobytes()
    key = SECRET[:32]
    fns: dict[str, Callable[[], object]] = {
        "XXH3-64 payload checksum (values read without a secret)": lambda: xxhash.xxh3_64_intdigest(data),
        "BLAKE3 keyed MAC (with LMI_CACHE_REMOTE_SECRET)": lambda: blake3.blake3(data, key=key).digest(),
        "HMAC-SHA256 (the alternative, not used)": lambda: hmac.digest(key, data, hashlib.sha256),
    }
    times = interleaved_best(args.repeats, list(fns.values()), time.thread_time)
    print("## Integrity checks per core (32 MiB, thread CPU time)\n")
    print("| check | GiB/s | CPU s per GiB |")
    print("|---|---|---|")
    for name, seconds in zip(fns, times):
        print(f"| {name} | {len(data) / seconds / 2**30:.2f} | {seconds / (len(data) / 2**30):.3f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[0.25, 1.0, 4.0], help="value sizes")
    parser.add_argument("--total-mib", type=float, default=128, help="bytes read per measured round")
    parser.add_argument("--batch", type=int, default=8, help="chunks per read_many / MGET")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mac", action=argparse.BooleanOptionalAction, default=True, help="also rows with a MAC")
    parser.add_argument("--models", nargs="+", default=["7m", "32m"], help="tiny model sizes for compression")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens per model")
    parser.add_argument("--skip", choices=["retrieve", "compression", "integrity"], action="append", default=[])
    args = parser.parse_args()
    if "retrieve" not in args.skip:
        bench_retrieve(args)
    if "compression" not in args.skip:
        bench_compression(args)
    if "integrity" not in args.skip:
        bench_integrity(args)


if __name__ == "__main__":
    main()
