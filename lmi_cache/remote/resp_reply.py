"""Read one array-of-bulk-strings reply (MGET's, RESP2 or RESP3) from a socket straight into caller memory.

redis-py (with hiredis) hands each value over as a new ``bytes`` after
copying it through its read buffers; for a 32M model's 8k-token prompt that is
124 MiB through 3-4 memory passes, and half of a Redis hit's load time here.
This reader asks ``allocate`` for each value's memory and lets the kernel copy
the socket's bytes into it with ``recv_into``: one pass, and the memory is the
host buffer the chunk object lives in, so no copy follows. The first
``split_at`` bytes of each value (its value header) go to a small ``bytes``.

Only the reply of one command sent on a connection that has nothing else in
flight is read; a reply that is not an array of bulk strings (an error, say)
raises ``ReplyError``, and any socket error propagates, so the caller must
drop the connection: its stream position is unknown.
"""
from __future__ import annotations

from typing import Any, Protocol

from lmi_cache.remote.store import BodyAllocator, ReceivedValue

_LINE_READ_BYTES = 64 << 10  # one recv for a header line; whatever of a value it takes is copied once
_MAX_LINE_BYTES = 1 << 16


class ReplyError(Exception):
    """The reply was not what MGET returns (a server error or a protocol fault)."""


class _Socket(Protocol):
    def recv(self, size: int) -> bytes: ...

    def recv_into(self, buffer: memoryview, nbytes: int = 0) -> int: ...


class BulkArrayReader:
    def __init__(self, sock: _Socket) -> None:
        self._sock = sock
        self._pending = bytearray()  # bytes received past what has been consumed

    def read_values(self, split_at: int, allocate: BodyAllocator) -> list[ReceivedValue | None]:
        """The reply's values in order (None where a key is absent)."""
        count = self._length(self._line(), b"*")
        if count < 0:
            raise ReplyError("null array reply")
        values: list[ReceivedValue | None] = []
        for _ in range(count):
            line = self._line()
            if line == b"_":  # RESP3's null (redis-py may negotiate protocol 3)
                values.append(None)
                continue
            size = self._length(line, b"$")
            values.append(None if size < 0 else self._value(size, split_at, allocate))
        if self._pending:
            raise ReplyError(f"{len(self._pending)} unexpected bytes after the reply")
        return values

    def _value(self, size: int, split_at: int, allocate: BodyAllocator) -> ReceivedValue:
        head_view = memoryview(bytearray(min(size, split_at)))
        self._fill(head_view)
        body_bytes = size - len(head_view)
        owner: Any = None
        body = memoryview(b"")
        if body_bytes:
            given = allocate(body_bytes)
            if given is None:  # no host memory: a plain buffer (the caller then fails to adopt it)
                body = memoryview(bytearray(body_bytes))
            else:
                owner, body = given[0], given[1][:body_bytes]
            self._fill(body)
        if self._take(2) != b"\r\n":
            raise ReplyError("bulk string not terminated by CRLF")
        return ReceivedValue(head_view.tobytes(), body, owner)

    def _length(self, line: bytes, kind: bytes) -> int:
        if line[:1] == b"-":
            raise ReplyError(line[1:].decode("utf-8", "replace"))
        if line[:1] != kind:
            raise ReplyError(f"expected {kind.decode()} reply, got {line[:16]!r}")
        try:
            return int(line[1:])
        except ValueError:
            raise ReplyError(f"bad length {line[:32]!r}") from None

    def _line(self) -> bytes:
        start = 0
        while True:
            end = self._pending.find(b"\r\n", start)
            if end >= 0:
                line = bytes(self._pending[:end])
                del self._pending[: end + 2]
                return line
            if len(self._pending) > _MAX_LINE_BYTES:
                raise ReplyError("reply line too long")
            start = max(0, len(self._pending) - 1)
            self._receive(_LINE_READ_BYTES)

    def _take(self, size: int) -> bytes:
        while len(self._pending) < size:
            self._receive(size - len(self._pending))
        taken = bytes(self._pending[:size])
        del self._pending[:size]
        return taken

    def _fill(self, view: memoryview) -> None:
        """Fill ``view``: first from what is already received, then straight from the socket."""
        filled = min(len(self._pending), len(view))
        if filled:
            view[:filled] = self._pending[:filled]
            del self._pending[:filled]
        while filled < len(view):
            count = self._sock.recv_into(view[filled:])
            if count == 0:
                raise ConnectionError("connection closed in the middle of a reply")
            filled += count

    def _receive(self, size: int) -> None:
        data = self._sock.recv(size)
        if not data:
            raise ConnectionError("connection closed in the middle of a reply")
        self._pending += data
