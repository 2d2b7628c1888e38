"""File I/O of the disk tier: atomic object files, O_DIRECT, start-up scan (torch-free, worker process).

A chunk object is written to ``<hex>.lmc.<pid>-<tid>.tmp`` beside its final
name and renamed over it with ``os.replace``, so a crash at any instant leaves
either no file, the complete old file, or a ``*.tmp`` that the next start-up
removes. Files are 0600, directories 0700; reads accept only regular files
of ours, opened without following links (``trust``). With O_DIRECT the
object is copied into a page-aligned buffer and zero-padded to a 4 KiB multiple (the header
records the real length); filesystems that refuse O_DIRECT (tmpfs: EINVAL)
raise OdirectUnsupported so the caller can fall back to buffered I/O.
"""
from __future__ import annotations

import errno
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from lmi_cache.keys.chunk_format import HEADER_BYTES, BytesLike, ChunkHeader, byte_view
from lmi_cache.tiers.disk.trust import entry_problem, is_our_dir, open_chunk

ALIGN_BYTES = 4096
FILE_SUFFIX = ".lmc"
_NAME_RE = re.compile(r"^([0-9a-f]{32})\.lmc$")
_TMP_RE = re.compile(r"^[0-9a-f]{32}\.lmc\.(\d+)-\d+\.tmp$")
STALE_TMP_S = 600.0  # a tmp file this old is garbage even if its pid is alive (pid reuse)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class OdirectUnsupported(OSError):
    """The filesystem refuses O_DIRECT for this file (retry buffered)."""


def round_up(num_bytes: int, align: int = ALIGN_BYTES) -> int:
    return -(-num_bytes // align) * align


def aligned_buffer(num_bytes: int) -> np.ndarray:
    """A uint8 array of ``round_up(num_bytes)`` bytes whose address is 4 KiB aligned."""
    padded = round_up(max(num_bytes, 1))
    raw = np.empty(padded + ALIGN_BYTES, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN_BYTES
    return raw[offset : offset + padded]


_scratch = threading.local()


def scratch_buffer(num_bytes: int, slot: str) -> np.ndarray:
    """A per-thread aligned buffer of ``round_up(num_bytes)`` bytes, reused across calls (warm pages)."""
    padded = round_up(max(num_bytes, 1))
    buffer: np.ndarray | None = getattr(_scratch, slot, None)
    if buffer is None or len(buffer) < padded:
        buffer = aligned_buffer(padded)
        setattr(_scratch, slot, buffer)
    return buffer[:padded]


def is_aligned(buffer: np.ndarray, num_bytes: int) -> bool:
    return buffer.ctypes.data % ALIGN_BYTES == 0 and len(buffer) >= round_up(num_bytes)


def object_path(root: str, digest: bytes) -> str:
    hex_digest = digest.hex()
    return os.path.join(root, hex_digest[:2], hex_digest + FILE_SUFFIX)


def ensure_dir(path: str) -> None:
    """Create ``path`` (and parents) private to the user; existing dirs keep their mode."""
    os.makedirs(path, mode=0o700, exist_ok=True)


def _write_all(fd: int, data: memoryview) -> None:
    offset = 0
    while offset < len(data):
        offset += os.write(fd, data[offset:])


def write_object_file(
    path: str,
    header: ChunkHeader,
    payload: BytesLike,
    *,
    odirect: bool,
    fsync: bool,
    object_buffer: np.ndarray | None = None,
) -> int:
    """Atomically write header + payload to ``path``; returns the file size in bytes.

    ``object_buffer`` (optional, writable) holds the payload at ``HEADER_BYTES``:
    if it is page-aligned with room for the padding, O_DIRECT writes it in
    place (its header bytes and padding are overwritten) instead of copying.
    """
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    # O_EXCL | O_NOFOLLOW: never write through a link or into a file someone placed at our tmp name.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (_O_DIRECT if odirect else 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileExistsError:
            os.unlink(tmp)  # our own leftover (same pid and thread), or a plant: either way not ours to use
            fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        ensure_dir(os.path.dirname(path))
        fd = os.open(tmp, flags, 0o600)
    except OSError as err:
        if odirect and err.errno == errno.EINVAL:
            raise OdirectUnsupported(err.errno, "O_DIRECT refused", tmp) from None
        raise
    try:
        try:
            if odirect:
                size = round_up(header.total_bytes)
                if object_buffer is not None and is_aligned(object_buffer, size):
                    buffer = object_buffer[:size]
                else:
                    buffer = scratch_buffer(size, "write")
                    buffer[HEADER_BYTES : header.total_bytes] = np.frombuffer(payload, dtype=np.uint8)
                buffer[:HEADER_BYTES] = np.frombuffer(header.pack(), dtype=np.uint8)
                buffer[header.total_bytes :] = 0  # no stale bytes of recycled buffers on disk
                _write_all(fd, byte_view(buffer))
            else:
                size = header.total_bytes
                _write_all(fd, memoryview(header.pack()))
                _write_all(fd, byte_view(payload))
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as err:
        _unlink_quietly(tmp)
        if odirect and isinstance(err, OSError) and err.errno == errno.EINVAL:
            raise OdirectUnsupported(err.errno, "O_DIRECT write refused", path) from None
        raise
    return size


def read_file_into(path: str, buffer: np.ndarray, *, odirect: bool) -> int:
    """Read the chunk file at ``path`` into ``buffer`` (uint8, page-aligned, a multiple of 4 KiB
    long when ``odirect``); returns the bytes read. A file longer than the buffer is cut short
    (the checksum then rejects it)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if odirect else 0)
    try:
        fd = open_chunk(path, flags)
    except OSError as err:
        if odirect and err.errno == errno.EINVAL:
            raise OdirectUnsupported(err.errno, "O_DIRECT refused", path) from None
        raise
    try:
        view = byte_view(buffer)
        offset = 0
        while offset < len(view):
            try:
                count = os.preadv(fd, [view[offset:]], offset)
            except OSError as err:
                if odirect and err.errno == errno.EINVAL:
                    raise OdirectUnsupported(err.errno, "O_DIRECT read refused", path) from None
                raise
            if count == 0:
                break
            offset += count
        return offset
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _our_subdir(entry: os.DirEntry[str], report: Callable[[str], None]) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if is_our_dir(info):
        return True
    if entry.is_symlink() or entry.is_dir(follow_symlinks=False):
        report("symlink" if entry.is_symlink() else "unsafe_dir")
    return False


@dataclass(frozen=True)
class ScannedFile:
    digest: bytes
    size_bytes: int
    mtime_ns: int


def scan_root(
    root: str, remove_garbage: bool = True, on_untrusted: Callable[[str], None] | None = None
) -> list[ScannedFile]:
    """Object files under ``root`` (names and stat only, no payload reads), oldest first.

    With ``remove_garbage``, leftovers of crashed writers (``*.tmp`` of dead
    processes, or stale ones) and files too short to hold a header are deleted.
    Entries that are not ours (symlinks, FIFOs, devices, other owners' files or
    subdirectories) are skipped and reported to ``on_untrusted`` with a reason, never deleted.
    """
    found: list[ScannedFile] = []
    now = time.time()
    report = on_untrusted if on_untrusted is not None else (lambda reason: None)
    try:
        subdirs = [e for e in os.scandir(root) if len(e.name) == 2 and _our_subdir(e, report)]
    except FileNotFoundError:
        return found
    for subdir in subdirs:
        try:
            entries = list(os.scandir(subdir.path))
        except OSError:
            continue
        for entry in entries:
            match = _NAME_RE.match(entry.name)
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            problem = entry_problem(stat)
            if problem is not None:
                if match or _TMP_RE.match(entry.name):
                    report(problem)
                continue
            if match and match.group(1)[:2] == subdir.name:
                if stat.st_size < HEADER_BYTES:  # torn before the rename? never valid
                    if remove_garbage:
                        _unlink_quietly(entry.path)
                    continue
                found.append(ScannedFile(bytes.fromhex(match.group(1)), stat.st_size, stat.st_mtime_ns))
                continue
            tmp = _TMP_RE.match(entry.name)
            if tmp and remove_garbage:
                pid = int(tmp.group(1))
                if pid == os.getpid() or not _pid_alive(pid) or now - stat.st_mtime > STALE_TMP_S:
                    _unlink_quietly(entry.path)
    found.sort(key=lambda f: (f.mtime_ns, f.digest))
    return found
