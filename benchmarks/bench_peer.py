"""Peer tier benchmark: one document loaded from a peer, from the CPU tier and from Redis, in the same run.

Run: ``.venv/bin/python benchmarks/bench_peer.py`` (about a minute; needs the
Mooncake transfer engine (``pip install -e .[peer]``) and ``redis-server`` on
PATH; ``--help``). Engine level, no vLLM: three ``CacheEngine``s in this
process, each load is ``CacheEngine.load`` as the connector's worker calls it,
and every loaded chunk's payload is copied once into a preallocated tensor
(the connector's scatter into vLLM's KV cache) before the round counts as done:

- ``cpu``: the document is in the reader's own CPU tier (a reference, then the copy);
- ``peer``: it is in another engine's CPU tier; the reader leases it over ZMQ
  and reads it with the transfer engine over TCP on loopback (``peer@H:P``
  sources, as the scheduler plans them), verifies every chunk, then copies;
- ``redis``: it is in a local redis-server; one batched GET, every value verified;
- ``transfer engine alone``: the same bytes read between two bare engines
  (no lease, no checks, no copy): what the peer path's transport gives.

Rounds are interleaved (cpu, peer, redis, cpu, ...); the table gives the
median per-document time, its bytes per second, and each path's ratio to
the CPU-tier hit measured in the same rounds.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from interleaved import medians  # noqa: E402

from lmi_cache.config.cache_config import config_from_dict  # noqa: E402
from lmi_cache.devtools.redis_server import RedisServer, free_port  # noqa: E402
from lmi_cache.engine import CacheEngine  # noqa: E402
from lmi_cache.keys.hashing import KeySpace  # noqa: E402
from lmi_cache.peer.node import start_peer_node  # noqa: E402
from lmi_cache.peer.protocol import PeerIdentity  # noqa: E402
from lmi_cache.peer.transport import PeerTransport, transport_available  # noqa: E402

MIB = 1 << 20
CHUNK_TOKENS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk-mib", type=float, nargs="+", default=[1.0, 4.0], help="payload MiB per chunk")
    parser.add_argument("--doc-chunks", type=int, default=8, help="chunks per document")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per size")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one copy thread, as a loaded serving host gives a load; timings stay comparable
    missing = transport_available()
    if missing is not None:
        sys.exit(f"bench_peer: {missing}")
    print("| chunk | document | path | ms per document | GiB/s | vs CPU-tier hit |")
    print("|---|---|---|---|---|---|")
    with RedisServer() as redis:
        for chunk_mib in args.chunk_mib:
            for row in bench_size(redis.url, chunk_mib, args.doc_chunks, args.rounds):
                print(row)


def engine(extra: dict[str, object]) -> CacheEngine:
    config, _ = config_from_dict({"chunk_size": CHUNK_TOKENS, "max_local_cpu_size": 1.0, **extra})
    return CacheEngine(config, page_locked=False)


def bench_size(redis_url: str, chunk_mib: float, doc_chunks: int, rounds: int) -> list[str]:
    space = KeySpace(model="bench", kv_dtype="float32", layout="bench", chunk_size=CHUNK_TOKENS)
    keys = space.keys(list(range(CHUNK_TOKENS * doc_chunks)), 0)
    numel = int(chunk_mib * MIB) // 4
    data = torch.randn(numel)
    identity = PeerIdentity.of(space)
    holder, reader = (engine({"enable_p2p": True, "p2p_init_ports": [p], "p2p_lookup_ports": [p + 1]})
                      for p in (free_port(), free_port()))
    shared = engine({"local_cpu": False, "remote_url": redis_url})
    nodes = [start_peer_node(e.config, identity, 0, 1, e) for e in (holder, reader)]
    try:
        assert all(nodes), "peer tier did not start"
        def fill(outs: list[torch.Tensor]) -> None:
            for out_chunk in outs:
                out_chunk.copy_(data)

        for target in (holder, reader, shared):
            target.save_many(keys, (numel,), torch.float32, fill)
        shared.flush(60.0)
        peer_source = f"peer@127.0.0.1:{holder.config.p2p_init_ports[0]}"
        out = torch.empty(numel)

        def load(target: CacheEngine, sources: list[str] | None) -> None:
            found = 0
            for batch in target.load(keys, sources, [False] * len(keys) if sources else None):
                for _, obj in batch:
                    out.copy_(obj.payload_tensor())  # the scatter into vLLM's KV cache
                    obj.release()
                    found += 1
            assert found == len(keys), f"{found} of {len(keys)} chunks loaded"

        src, dst = torch.zeros(numel * doc_chunks), torch.empty(numel * doc_chunks)
        engines = (PeerTransport("127.0.0.1"), PeerTransport("127.0.0.1"))
        assert engines[0].register(src.data_ptr(), numel * 4 * doc_chunks)
        assert engines[1].register(dst.data_ptr(), numel * 4 * doc_chunks)
        offsets = [i * numel * 4 for i in range(doc_chunks)]

        def raw_read() -> None:  # the transfer engine alone: the same bytes, no lease, no checks, no copy
            assert engines[1].read(engines[0].session_id, [dst.data_ptr() + o for o in offsets],
                                   [src.data_ptr() + o for o in offsets], [numel * 4] * doc_chunks)

        paths: dict[str, Callable[[], object]] = {"cpu": lambda: load(reader, None), "peer": lambda: load(reader, [peer_source] * len(keys)),
                 "redis": lambda: load(shared, None), "transfer engine alone": raw_read}
        times = medians(rounds, paths, warm_up=True)
    finally:
        for node in nodes:
            if node is not None:
                node.close()
        for target in (holder, reader, shared):
            target.close()
    doc_bytes = numel * 4 * doc_chunks
    cpu = times["cpu"]
    rows = []
    for name, median in times.items():
        ratio = "1.00x" if name == "cpu" else f"{median / cpu:.2f}x slower"
        rows.append(f"| {chunk_mib:g} MiB | {doc_bytes / MIB:g} MiB | {name} | {median * 1000:.1f} | "
                    f"{doc_bytes / median / (1 << 30):.2f} | {ratio} |")
    return rows


if __name__ == "__main__":
    main()
