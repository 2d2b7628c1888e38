"""BulkArrayReader: an MGET reply read from a socket straight into caller memory, however the bytes arrive."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.remote.resp_reply import BulkArrayReader, ReplyError


class ChoppySocket:
    """A socket whose recv/recv_into hand out the stream in the sizes a seeded generator picks."""

    def __init__(self, stream: bytes, seed: int, max_piece: int = 700) -> None:
        self._stream = memoryview(stream)
        self._at = 0
        self._rng = random.Random(seed)
        self._max = max_piece

    def _next(self, limit: int) -> memoryview:
        size = min(limit, self._rng.randint(1, self._max), len(self._stream) - self._at)
        piece = self._stream[self._at : self._at + size]
        self._at += size
        return piece

    def recv(self, size: int) -> bytes:
        return bytes(self._next(size))

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        piece = self._next(len(view))
        view[: len(piece)] = piece
        return len(piece)


def mget_reply(values: list[bytes | None], resp3: bool = False) -> bytes:
    out = [b"*%d\r\n" % len(values)]
    null = b"_\r\n" if resp3 else b"$-1\r\n"
    for value in values:
        out.append(null if value is None else b"$%d\r\n%s\r\n" % (len(value), value))
    return b"".join(out)


class Memory:
    """An allocator handing out bytearrays (bigger than asked, like size classes), or none when told to."""

    def __init__(self, refuse: bool = False) -> None:
        self.given: list[bytearray] = []
        self.refuse = refuse

    def __call__(self, num_bytes: int) -> tuple[bytearray, memoryview] | None:
        if self.refuse:
            return None
        buffer = bytearray(num_bytes + 17)
        self.given.append(buffer)
        return buffer, memoryview(buffer)


values_strategy = st.lists(st.one_of(st.none(), st.binary(max_size=3000)), max_size=8)


@settings(max_examples=150, deadline=None)
@given(values=values_strategy, split_at=st.integers(0, 80), seed=st.integers(0, 2**16), refuse=st.booleans(),
       resp3=st.booleans())
def test_values_land_in_the_callers_memory_whatever_the_chunking(
    values: list[bytes | None], split_at: int, seed: int, refuse: bool, resp3: bool
) -> None:
    memory = Memory(refuse)
    received = BulkArrayReader(ChoppySocket(mget_reply(values, resp3), seed)).read_values(split_at, memory)
    assert len(received) == len(values)
    for value, got in zip(values, received):
        if value is None:
            assert got is None
            continue
        assert got is not None
        assert got.head == value[:split_at]
        assert bytes(got.body) == value[split_at:]
        if len(value) > split_at and not refuse:
            assert any(got.owner is given for given in memory.given)  # the allocator's memory, not a copy
        else:
            assert got.owner is None


def test_a_server_error_reply_is_a_reply_error_with_its_message() -> None:
    with pytest.raises(ReplyError, match="WRONGTYPE"):
        BulkArrayReader(ChoppySocket(b"-WRONGTYPE Operation against a key\r\n", 0)).read_values(4, Memory())


@pytest.mark.parametrize("stream, error", [
    (mget_reply([b"abcdef"])[:-5], ConnectionError),  # the connection closed mid-value
    (mget_reply([b"abcdef"]) + b"+OK\r\n", ReplyError),  # bytes after the reply: the stream is out of step
    (b"*1\r\n$6\r\nabcdefXY", ReplyError),  # a bulk string not ended by CRLF
    (b"+OK\r\n", ReplyError),  # not an array
    (b"*1\r\n:12\r\n", ReplyError),  # an array of something else
    (b"*x\r\n", ReplyError),
])
def test_a_malformed_or_cut_reply_raises(stream: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        BulkArrayReader(ChoppySocket(stream, 1)).read_values(2, Memory())
