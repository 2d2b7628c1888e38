"""The peer tier's server and client over two real transfer engines on loopback (no vLLM)."""
from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from local_ports import free_port_block  # noqa: E402

from lmi_cache.keys.chunk_format import ChunkHeader
from lmi_cache.keys.hashing import ChunkKey
from lmi_cache.peer.client import PeerClient
from lmi_cache.peer.hint import PeerAddress
from lmi_cache.peer.protocol import PeerIdentity
from lmi_cache.peer.server import PeerServer
from lmi_cache.peer.transport import PeerTransport, transport_available
from lmi_cache.tiers.host_memory import ChunkObject, HostAllocator

def test_the_transfer_engine_is_installed() -> None:
    # scripts/setup.sh installs it (the [peer] extra and Debian's verbs libraries); the tests below need it.
    assert transport_available() is None

IDENTITY = PeerIdentity(model="tiny", model_identity="sha:1", kv_dtype="float32", layout="cpu.s0123.float32",
                        chunk_size=16, tp_size=1, pp_size=1)
ALLOC = HostAllocator(page_locked=False)


def key_of(number: int) -> ChunkKey:
    return ChunkKey(number.to_bytes(16, "little"), 0, 16, number * 7 + 1)


def make_object(number: int, num_values: int = 4096) -> ChunkObject:
    data = torch.arange(num_values, dtype=torch.float32) + number
    header = ChunkHeader.for_key(key_of(number), num_values * 4, "float32", (num_values,))
    obj = ALLOC.new_object(key_of(number), header)
    assert obj is not None
    obj.payload_tensor().copy_(data)
    return obj


class Holder:
    """A CPU tier's view for peers: references to held objects."""

    def __init__(self) -> None:
        self.objects: dict[bytes, ChunkObject] = {}

    def __call__(self, digest: bytes) -> ChunkObject | None:
        obj = self.objects.get(digest)
        return None if obj is None else obj.acquire()


@pytest.fixture(scope="module")
def transports() -> Iterator[tuple[PeerTransport, PeerTransport]]:
    yield PeerTransport("127.0.0.1"), PeerTransport("127.0.0.1")


@pytest.fixture
def holder() -> Holder:
    held = Holder()
    for number in (1, 2, 3):
        held.objects[key_of(number).digest] = make_object(number)
    return held


def make_server(transports: tuple[PeerTransport, PeerTransport], holder: Holder, **kw: object) -> PeerServer:
    return PeerServer(kw.pop("identity", IDENTITY), transports[0], holder, host="127.0.0.1",  # type: ignore[arg-type]
                      init_port=0, lookup_port=0, **kw)  # type: ignore[arg-type]


def make_client(transports: tuple[PeerTransport, PeerTransport], faults: Counter[str], *, timeout_ms: int = 2000,
                lease_ms: int = 2000, identity: PeerIdentity = IDENTITY) -> PeerClient:
    return PeerClient(identity, transports[1], rank=0, timeout_ms=timeout_ms, lease_ms=lease_ms,
                      allocate=ALLOC.allocate, recycle=ALLOC.recycle, count_fault=faults.update_one)


class _Faults(Counter[str]):
    def update_one(self, reason: str) -> None:
        self[reason] += 1


def payload_of(header: ChunkHeader, buffer: torch.Tensor) -> torch.Tensor:
    return ChunkObject(key_of(0), header, buffer, None).payload_tensor()


def test_hit_reads_exact_bytes_and_misses_what_the_peer_lacks(transports, holder) -> None:
    server = make_server(transports, holder)
    faults = _Faults()
    client = make_client(transports, faults)
    try:
        got = client.read_many(PeerAddress("127.0.0.1", server.init_port), [key_of(1), key_of(9), key_of(3)])
        assert got[1] is None
        for position, number in ((0, 1), (2, 3)):
            entry = got[position]
            assert entry is not None
            header, buffer = entry
            assert (header.digest, header.fingerprint) == (key_of(number).digest, key_of(number).fingerprint)
            assert torch.equal(payload_of(header, buffer), torch.arange(4096, dtype=torch.float32) + number)
        assert not faults
        deadline = time.monotonic() + 2
        while server.num_leases and time.monotonic() < deadline:  # released after the read
            time.sleep(0.01)
        assert server.num_leases == 0
        assert all(obj.refs == 1 for obj in holder.objects.values())  # the lease's references went back
    finally:
        client.close()
        server.close()


def test_corrupted_bytes_are_a_counted_miss(transports, holder) -> None:
    server = make_server(transports, holder, corrupt_for_test=True)
    faults = _Faults()
    client = make_client(transports, faults)
    try:
        got = client.read_many(PeerAddress("127.0.0.1", server.init_port), [key_of(1), key_of(2)])
        assert got == [None, None]
        assert faults["corrupted"] == 2
    finally:
        client.close()
        server.close()


def test_a_chunk_under_another_key_is_refused(transports, holder) -> None:
    holder.objects[key_of(5).digest] = holder.objects[key_of(1).digest]  # the header names key 1, not key 5
    server = make_server(transports, holder)
    faults = _Faults()
    client = make_client(transports, faults)
    try:
        assert client.read_many(PeerAddress("127.0.0.1", server.init_port), [key_of(5)]) == [None]
    finally:
        client.close()
        server.close()


def test_layout_mismatch_is_refused_and_remembered(transports, holder) -> None:
    server = make_server(transports, holder)
    faults = _Faults()
    client = make_client(transports, faults, identity=replace(IDENTITY, tp_size=2))
    try:
        peer = PeerAddress("127.0.0.1", server.init_port)
        assert client.read_many(peer, [key_of(1)]) == [None]
        assert client.read_many(peer, [key_of(1)]) == [None]
        assert faults["refused"] == 2
        assert server.num_leases == 0  # nothing was leased to a mismatched reader
    finally:
        client.close()
        server.close()


def test_peer_gone_is_a_bounded_miss(transports, holder) -> None:
    server = make_server(transports, holder)
    peer = PeerAddress("127.0.0.1", server.init_port)
    server.close()
    faults = _Faults()
    client = make_client(transports, faults, timeout_ms=300)
    try:
        started = time.monotonic()
        assert client.read_many(peer, [key_of(1)]) == [None]
        assert time.monotonic() - started < 2.0  # the bound (300 ms) plus slack for a loaded host
        assert faults["timeout"] == 1
    finally:
        client.close()


def test_lease_expiry_releases_the_chunks(transports, holder) -> None:
    server = make_server(transports, holder)
    try:
        import zmq

        from lmi_cache.peer.protocol import PROTOCOL, pack, unpack

        socket = zmq.Context.instance().socket(zmq.REQ)
        socket.setsockopt(zmq.RCVTIMEO, 2000)
        socket.connect(f"tcp://127.0.0.1:{server.lookup_port}")
        socket.send(pack({"op": "lookup", "digests": [key_of(1).digest], "lease_ms": 100,
                          "identity": IDENTITY.to_wire(), "protocol": PROTOCOL}))
        reply = unpack(socket.recv())
        socket.close(linger=0)
        obj = holder.objects[key_of(1).digest]
        assert reply["ok"] and reply["chunks"][0] is not None
        assert obj.refs == 2 and server.num_leases == 1  # pinned under the lease
        deadline = time.monotonic() + 3
        while server.num_leases and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.num_leases == 0 and obj.refs == 1  # expired without a release
        assert transports[0].num_registered == 0
    finally:
        server.close()


def test_rank_r_asks_and_reads_rank_r_of_the_peer(transports, holder) -> None:
    """Two ranks of one peer (TP 2): the hint names rank 0's port; rank 1's questions and reads go to rank 1."""
    from lmi_cache.peer.lookup import PeerLookups

    tp2 = replace(IDENTITY, tp_size=2)
    rank1 = Holder()
    rank1.objects[key_of(11).digest] = make_object(11)  # rank 1's key of chunk 0; its chunk 1 is missing
    first = free_port_block(4)
    init_ports = [first, first + 2]  # what start_peer_node passes: every rank's handshake port
    servers = [PeerServer(tp2, transports[0], held, host="127.0.0.1", init_port=init_ports[rank],
                          lookup_port=init_ports[rank] + 1, init_ports=init_ports)
               for rank, held in enumerate((holder, rank1))]
    peer = PeerAddress("127.0.0.1", init_ports[0])
    lookups = PeerLookups(2000, world_size=2)
    lookups.set_identity(tp2)
    faults = _Faults()
    client = make_client(transports, faults, identity=tp2)
    reader = PeerClient(tp2, transports[1], rank=1, timeout_ms=2000, lease_ms=2000, allocate=ALLOC.allocate,
                        recycle=ALLOC.recycle, count_fault=faults.update_one)
    try:
        pending = lookups.ask(peer, [key_of(1), key_of(11), key_of(2), key_of(12)])  # chunk 0, chunk 1; rank order
        deadline = time.monotonic() + 3
        while (held := pending.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held == [True, True, True, False] and pending.outcome == "answered"
        assert [e is not None for e in reader.read_many(peer, [key_of(11), key_of(1)])] == [True, False]
        assert [e is not None for e in client.read_many(peer, [key_of(11), key_of(1)])] == [False, True]
        assert not faults
    finally:
        lookups.close()
        client.close()
        reader.close()
        for server in servers:
            server.close()


def test_a_peer_killed_between_lease_and_read_is_a_bounded_miss(transports) -> None:
    """The peer process dies once it has leased the chunks, as the reader starts moving the bytes."""
    import subprocess

    helper = Path(__file__).with_name("peer_process.py")
    proc = subprocess.Popen([sys.executable, str(helper), "8", str(1 << 20)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        peer = PeerAddress("127.0.0.1", int(proc.stdout.readline()))
        faults = _Faults()

        def allocate_after_killing(num_bytes: int) -> torch.Tensor | None:
            if proc.poll() is None:  # the lease is granted: the peer goes away now
                proc.kill()
                proc.wait()
            return ALLOC.allocate(num_bytes)

        client = PeerClient(IDENTITY, transports[1], rank=0, timeout_ms=1500, lease_ms=3000,
                            allocate=allocate_after_killing, recycle=ALLOC.recycle, count_fault=faults.update_one)
        try:
            started = time.monotonic()
            assert client.read_many(peer, [key_of(n) for n in range(1, 9)]) == [None] * 8
            assert time.monotonic() - started < 4.0  # the 1.5 s bound plus slack for a loaded host
            assert proc.returncode is not None and set(faults) <= {"transfer", "timeout"} and faults
        finally:
            client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
