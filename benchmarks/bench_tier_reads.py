"""What reading one 32M-model query's chunks costs on this host: disk (page cache vs device) and Redis.

Run: ``.venv/bin/python benchmarks/bench_tier_reads.py`` (about 1 minute; needs
``redis-server`` on PATH; ``--help``). A 32M tiny model's 8,000-token query
loads 31 chunks of 4 MiB; this script moves the same bytes without vLLM, so the
connector benchmark's tier rows can be read against the floor the host sets.

1. Disk: 31 chunk files in ``--dir`` (default: a temporary folder), read with
   the disk tier's own reader function from the page cache and with O_DIRECT
   (from the device, as after the page cache was reclaimed), with 1-8 threads.
2. Redis: 31 values in a loopback redis-server of its own, read by a bare
   socket ``recv_into`` into ready buffers, as one MGET of all 31 and as
   consecutive MGETs of ``MGET_REPLY_BYTES`` each (the floor: redis-server
   sends one reply of tens of MiB far slower), by redis-py's ``mget`` (its
   parser, hiredis when installed; one MGET), and by the remote tier's store
   (``RedisStore.fetch_many_into``: consecutive MGETs, each reply received
   straight into ready buffers). Rounds alternate; medians, and ratios
   against the floor.
3. MGET sizes (``--skip sizes`` to leave out): the same 124 MiB as 4 MiB,
   1 MiB and 256 KiB values, read by a bare socket as one MGET, a GET loop,
   all GETs pipelined, and consecutive MGETs of 2 to 64 values: why the
   remote tier reads a batch as MGETs of about ``MGET_REPLY_BYTES``.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmi_cache.devtools.redis_server import RedisServer  # noqa: E402
from lmi_cache.remote.settings import RemoteSettings  # noqa: E402
from lmi_cache.tiers.disk import object_files  # noqa: E402

from interleaved import medians  # noqa: E402  (benchmarks/, beside this script)

MIB = 1 << 20


def bench_disk(args: argparse.Namespace, payloads: list[bytes]) -> None:
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        paths = []
        for number, payload in enumerate(payloads):
            path = os.path.join(folder, f"{number}.lmc")
            with open(path, "wb") as handle:
                handle.write(payload)
            paths.append(path)
        os.sync()
        buffers = [object_files.aligned_buffer(len(p)) for p in payloads]
        for buffer in buffers:
            buffer[:] = 0  # touched: the reads measure the reads, not page faults

        def reads(threads: int, odirect: bool) -> Callable[[], object]:
            pool = ThreadPoolExecutor(threads)
            return lambda: list(pool.map(lambda i: object_files.read_file_into(paths[i], buffers[i], odirect=odirect),
                                         range(len(paths))))

        fns = {f"{'O_DIRECT' if odirect else 'page cache'}, {threads} thread(s)": reads(threads, odirect)
               for odirect in (False, True) for threads in (1, 2, 4, 8)}
        result = medians(args.rounds, fns)
    total = sum(len(p) for p in payloads)
    print(f"## Disk: {len(payloads)} files of {len(payloads[0]) // MIB} MiB ({total / MIB:.0f} MiB)\n")
    print("| read | ms | GB/s |\n|---|---|---|")
    for name, seconds in result.items():
        print(f"| {name} | {seconds * 1000:.1f} | {total / seconds / 1e9:.2f} |")
    cached = min(v for k, v in result.items() if k.startswith("page"))
    device = min(v for k, v in result.items() if k.startswith("O_DIRECT"))
    print(f"\nFrom the device / from the page cache (best of each): {device / cached:.1f}x\n")


def mget_command(keys: list[str], name: bytes = b"MGET") -> bytes:
    return b"*%d\r\n$%d\r\n%s\r\n" % (len(keys) + 1, len(name), name) + b"".join(
        b"$%d\r\n%s\r\n" % (len(k), k.encode()) for k in keys)


def reply_bytes(payloads: list[bytes]) -> int:
    """Bytes of an MGET reply carrying ``payloads``."""
    return sum(len(p) + len(b"$%d\r\n\r\n" % len(p)) for p in payloads) + len(b"*%d\r\n" % len(payloads))


def bench_redis(args: argparse.Namespace, payloads: list[bytes]) -> None:
    from lmi_cache.remote.redis_store import MGET_REPLY_BYTES, RedisStore

    keys = [f"bench-reads:{number}" for number in range(len(payloads))]
    buffers = [np.zeros(len(p), dtype=np.uint8) for p in payloads]
    with RedisServer() as server:
        store = RedisStore(RemoteSettings(server.url, key_prefix="bench-reads", io_timeout_ms=30_000))
        client = store._client(lookup=False)
        client.mset(dict(zip(keys, payloads)))
        host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
        command = mget_command(keys)
        expected = reply_bytes(payloads)
        reply = np.zeros(expected, dtype=np.uint8)  # touched once, like the other readers' buffers

        def bare_socket() -> None:
            """One MGET reply's bytes into ready memory, nothing parsed."""
            with socket.create_connection((host, port)) as sock:
                sock.sendall(command)
                view, got = memoryview(reply), 0
                while got < expected:
                    got += sock.recv_into(view[got:])

        per_mget = max(1, MGET_REPLY_BYTES // len(payloads[0]))
        groups = [(mget_command(keys[i : i + per_mget]), reply_bytes(payloads[i : i + per_mget]))
                  for i in range(0, len(keys), per_mget)]

        def bare_socket_split() -> None:
            """The same bytes as consecutive MGETs of MGET_REPLY_BYTES, nothing parsed: the floor."""
            with socket.create_connection((host, port)) as sock:
                for group_command, group_bytes in groups:
                    sock.sendall(group_command)
                    view, got = memoryview(reply), 0
                    while got < group_bytes:
                        got += sock.recv_into(view[got:group_bytes])

        turn = iter(range(1 << 62))

        def ready_memory(num_bytes: int) -> tuple[np.ndarray, memoryview]:
            buffer = buffers[next(turn) % len(buffers)]
            return buffer, memoryview(buffer)

        fns = {
            "bare socket recv_into, MGETs of 8 MiB (floor)": bare_socket_split,
            "bare socket recv_into, one MGET": bare_socket,
            "redis-py mget": lambda: client.mget(keys),
            "remote tier's store: fetch_many_into": lambda: store.fetch_many_into(keys, 0, ready_memory),
        }
        result = medians(args.rounds, fns)
        store.close()
    total = sum(len(p) for p in payloads)
    floor = result["bare socket recv_into, MGETs of 8 MiB (floor)"]
    print(f"## Redis on loopback: one MGET of {len(payloads)} values of {len(payloads[0]) // MIB} MiB\n")
    print("| read | ms | GB/s | / floor |\n|---|---|---|---|")
    for name, seconds in result.items():
        print(f"| {name} | {seconds * 1000:.1f} | {total / seconds / 1e9:.2f} | {seconds / floor:.2f}x |")
    print()


def bench_mget_sizes(args: argparse.Namespace) -> None:
    """Bare-socket reads of 124 MiB as one MGET, GETs, and consecutive MGETs of a few values."""
    groups = (2, 4, 8, 16, 64)
    print("## Redis on loopback: the same 124 MiB in replies of different sizes (bare socket, ms)\n")
    print("| values | one MGET | GET loop | all GETs pipelined | " + " | ".join(f"MGETs of {g}" for g in groups)
          + " |\n|---|---|---|---|" + "---|" * len(groups))
    with RedisServer() as server:
        host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
        for size in (4 * MIB, MIB, MIB // 4):
            count = (124 * MIB) // size
            rng = np.random.default_rng(size)
            payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]
            keys = [f"bench-sizes:{size}:{n}" for n in range(count)]
            with socket.create_connection((host, port)) as sock:
                sock.sendall(b"".join(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k.encode(), size)
                                      + p + b"\r\n" for k, p in zip(keys, payloads)))
                reply = np.zeros(reply_bytes(payloads) + 64, dtype=np.uint8)
                receive(sock, reply, len(b"+OK\r\n") * count)

                def exchanges(parts: list[tuple[list[str], list[bytes]]], pipelined: bool = False) -> Callable[[], None]:
                    commands = [(b"".join(mget_command([k], b"GET") for k in ks) if name == "GETs"
                                 else mget_command(ks), expected) for name, ks, expected in parts]

                    def run() -> None:
                        if pipelined:
                            sock.sendall(b"".join(c for c, _ in commands))
                            receive(sock, reply, sum(e for _, e in commands))
                            return
                        for command, expected in commands:
                            sock.sendall(command)
                            receive(sock, reply, expected)
                    return run

                def split(per: int) -> list[tuple[str, list[str], int]]:
                    return [("MGET", keys[i : i + per], reply_bytes(payloads[i : i + per]))
                            for i in range(0, count, per)]

                single = [("GETs", [k], reply_bytes([p]) - len(b"*1\r\n")) for k, p in zip(keys, payloads)]
                fns = {"one MGET": exchanges(split(count)), "GET loop": exchanges(single),
                       "pipelined": exchanges(single, pipelined=True)}
                fns.update({f"of {g}": exchanges(split(g)) for g in groups})
                result = medians(args.rounds, fns)
            cells = " | ".join(f"{result[name] * 1000:.1f}" for name in fns)
            print(f"| {count} x {size / MIB:g} MiB | {cells} |")
    print()


def receive(sock: socket.socket, buffer: np.ndarray, num_bytes: int) -> None:
    view, got = memoryview(buffer), 0
    while got < num_bytes:
        got += sock.recv_into(view[got:num_bytes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=31, help="chunks per query (31: a 32M model's 8k tokens)")
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", default=None, help="folder for the disk files (default: the temp folder)")
    parser.add_argument("--skip", choices=["disk", "redis", "sizes"], action="append", default=[])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, args.chunk_mib * MIB, dtype=np.uint8).tobytes() for _ in range(args.chunks)]
    if "disk" not in args.skip:
        bench_disk(args, payloads)
    if "redis" not in args.skip:
        bench_redis(args, payloads)
    if "sizes" not in args.skip:
        bench_mget_sizes(args)


if __name__ == "__main__":
    main()
