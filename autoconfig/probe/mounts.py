"""Parse ``/proc/<pid>/mountinfo`` into typed entries (autoconfig probe, CLI process).

Both the memory probe (to find the cgroup hierarchies) and the disk probe (to
list filesystems) read the same file, so the parser lives here. It is a pure
function over the file's text so tests can feed it any mount table.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

# mountinfo escapes space, tab, newline and backslash as 3-digit octal.
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo (see proc(5)); paths are unescaped."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str  # the path inside the filesystem that is mounted here (bind mounts, cgroups)
    mount_point: str
    mount_options: tuple[str, ...]  # per-mount options ("ro", "nosuid", ...)
    fs_type: str
    source: str
    super_options: tuple[str, ...]  # per-superblock options ("ro", "cpu,memory" for cgroup v1, ...)

    @property
    def device_id(self) -> str:
        """``MAJ:MIN`` as used under ``/sys/dev/block``."""
        return f"{self.major}:{self.minor}"

    @property
    def read_only(self) -> bool:
        return "ro" in self.mount_options or "ro" in self.super_options


def unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """Parse mountinfo text; malformed lines are skipped (logged at debug), never fatal."""
    entries: list[MountEntry] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        entry = _parse_line(line)
        if entry is None:
            log.debug("skipping malformed mountinfo line: %r", line)
            continue
        entries.append(entry)
    return entries


def _parse_line(line: str) -> MountEntry | None:
    fields = line.split(" ")
    try:
        # A variable number of optional fields (shared:N, master:N...) ends at "-".
        sep = fields.index("-", 6)
        mount_id, parent_id = int(fields[0]), int(fields[1])
        major_text, minor_text = fields[2].split(":", 1)
        fs_type = fields[sep + 1]
        source = fields[sep + 2]
        super_options = fields[sep + 3] if len(fields) > sep + 3 else ""
        return MountEntry(
            mount_id=mount_id,
            parent_id=parent_id,
            major=int(major_text),
            minor=int(minor_text),
            root=unescape(fields[3]),
            mount_point=unescape(fields[4]),
            mount_options=tuple(fields[5].split(",")),
            fs_type=unescape(fs_type),
            source=unescape(source),
            super_options=tuple(o for o in super_options.split(",") if o),
        )
    except (ValueError, IndexError):
        return None


def read_mountinfo(proc_root: str = "/proc") -> list[MountEntry]:
    """The current process's mount table; ``[]`` when it cannot be read (not Linux)."""
    path = os.path.join(proc_root, "self", "mountinfo")
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return parse_mountinfo(f.read())
    except OSError as err:
        log.debug("cannot read %s: %s", path, err)
        return []


def visible_mounts(entries: list[MountEntry]) -> list[MountEntry]:
    """Drop mounts hidden by a later mount on the same mount point (the last one wins)."""
    top: dict[str, MountEntry] = {}
    for entry in entries:
        # Re-inserting moves the key to the end, so the table keeps mount order.
        top.pop(entry.mount_point, None)
        top[entry.mount_point] = entry
    return list(top.values())


def mount_holding(path: str, entries: list[MountEntry]) -> MountEntry | None:
    """The visible mount whose mount point is the longest prefix of ``path``."""
    best: MountEntry | None = None
    for entry in visible_mounts(entries):
        if is_under(path, entry.mount_point):
            if best is None or len(entry.mount_point) > len(best.mount_point):
                best = entry
    return best


def is_under(path: str, directory: str) -> bool:
    """True when ``path`` is ``directory`` or inside it (string test, no symlinks followed)."""
    directory = directory.rstrip("/") or "/"
    if directory == "/":
        return path.startswith("/")
    return path == directory or path.startswith(directory + "/")


def host_path(path: str, mount_root: str = "/") -> str:
    """Where an absolute path from mountinfo is found when the tree is rooted at ``mount_root``."""
    if mount_root in ("", "/"):
        return path
    return os.path.join(mount_root, path.lstrip("/"))
