"""Host snapshot types: what the probe finds, and what ``--host FILE`` reads.

The JSON form is a public contract (``lmi-cache probe --json`` prints it, and
``plan --host-snapshot`` / ``validate --host-snapshot`` read it back). Pure data, no I/O here
except parsing a dict that came from a file named by the caller.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from lmi_cache.errors import UserError
from lmi_cache.plain_files import PlainFileError, read_text_file, refuse_json_constant


class SnapshotError(UserError):
    """A host snapshot file is missing a field or has a bad value."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_total_bytes: int
    memory_free_bytes: int


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int
    available_bytes: int
    cgroup_limit_bytes: int | None  # None: no container limit
    memlock_limit_bytes: int | None  # None: unlimited
    shm_bytes: int
    cgroup_usage_bytes: int | None = None  # what the container already uses, if known

    @property
    def usable_bytes(self) -> int:
        """What this process tree can really still take: the smaller of RAM and cgroup headroom."""
        usable = self.available_bytes
        if self.cgroup_limit_bytes is not None:
            headroom = self.cgroup_limit_bytes - (self.cgroup_usage_bytes or 0)
            usable = min(usable, max(0, headroom))
        return max(0, usable)


@dataclass(frozen=True)
class DiskInfo:
    mount: str
    device: str
    fs_type: str
    total_bytes: int
    free_bytes: int
    rotational: bool | None  # None: unknown (no block device found)
    nvme: bool
    odirect: bool | None  # None: not tested (e.g. not writable)
    writable: bool = True
    is_tmpfs: bool = False
    is_overlay: bool = False
    is_network: bool = False


@dataclass(frozen=True)
class HostSnapshot:
    gpus: list[GpuInfo] = field(default_factory=list)
    memory: MemoryInfo = field(
        default_factory=lambda: MemoryInfo(0, 0, None, None, 0)
    )
    disks: list[DiskInfo] = field(default_factory=list)
    cpu_count: int | None = None
    rdma_drivers: list[str] = field(default_factory=list)  # driver of each /sys/class/infiniband device (efa, mlx5_core)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<snapshot>") -> "HostSnapshot":
        """Parse the JSON contract; raise SnapshotError naming ``source`` and the key."""
        if not isinstance(data, Mapping):
            raise SnapshotError(f"{source}: expected a JSON object with keys gpus, memory, disks")
        for key in ("gpus", "memory", "disks"):
            if key not in data:
                raise SnapshotError(f"{source}: missing key '{key}' (run 'lmi-cache probe --json' for the format)")
        gpus = [
            GpuInfo(**_take(g, source, f"gpus[{i}]", _GPU_FIELDS))
            for i, g in enumerate(_list(data["gpus"], source, "gpus"))
        ]
        memory = MemoryInfo(**_take(data["memory"], source, "memory", _MEMORY_FIELDS))
        disks = [
            DiskInfo(**_take(d, source, f"disks[{i}]", _DISK_FIELDS))
            for i, d in enumerate(_list(data["disks"], source, "disks"))
        ]
        cpu_count = data.get("cpu_count")
        if cpu_count is not None and (not isinstance(cpu_count, int) or isinstance(cpu_count, bool)
                                      or not 0 <= cpu_count <= _MAX_ITEMS):
            raise SnapshotError(f"{source}: 'cpu_count' must be an integer from 0 to {_MAX_ITEMS} or null")
        for i, disk in enumerate(disks):
            problem = _mount_problem(disk.mount)
            if problem:
                raise SnapshotError(f"{source}: 'disks[{i}].mount' {problem}; run 'lmi-cache probe --json' for the format")
        drivers = data.get("rdma_drivers", [])
        if not isinstance(drivers, list) or not all(isinstance(d, str) and len(d) < 64 for d in drivers[:_MAX_ITEMS]):
            raise SnapshotError(f"{source}: 'rdma_drivers' must be a list of driver names (e.g. [\"efa\"])")
        return cls(gpus=gpus, memory=memory, disks=disks, cpu_count=cpu_count, rdma_drivers=drivers[:_MAX_ITEMS])


def load_snapshot_file(path: str) -> HostSnapshot:
    """Read ``--host FILE`` (bytes, UTF-8, bounded size and depth) into a snapshot; SnapshotError otherwise."""
    import json

    try:
        text = read_text_file(path, _MAX_FILE_BYTES)
    except PlainFileError as err:
        raise SnapshotError(f"--host-snapshot {path}: {err}; use 'lmi-cache probe --json'") from None
    try:
        data = json.loads(text, parse_constant=refuse_json_constant)
    except json.JSONDecodeError as err:
        raise SnapshotError(f"--host-snapshot {path}: not valid JSON (line {err.lineno} column {err.colno}: {err.msg}); "
                            "use 'lmi-cache probe --json'") from None
    except (ValueError, RecursionError):
        raise SnapshotError(f"--host-snapshot {path}: not a host snapshot (NaN/Infinity, an over-long number or too deep "
                            "nesting); use 'lmi-cache probe --json'") from None
    return HostSnapshot.from_dict(data, path)


def _mount_problem(mount: str) -> str | None:
    # A control character can be real (/proc/mounts escapes it): the planner never picks such a mount.
    if not mount.startswith("/"):
        return f"must be an absolute path, got {mount[:60]!r}"
    return None


# name -> (types accepted, required)
_Spec = dict[str, tuple[tuple[type, ...], bool]]
_INT = (int,)
_OPT_INT = (int, type(None))
_OPT_BOOL = (bool, type(None))
_GPU_FIELDS: _Spec = {
    "index": (_INT, True),
    "name": ((str,), True),
    "memory_total_bytes": (_INT, True),
    "memory_free_bytes": (_INT, True),
}
_MEMORY_FIELDS: _Spec = {
    "total_bytes": (_INT, True),
    "available_bytes": (_INT, True),
    "cgroup_limit_bytes": (_OPT_INT, True),
    "memlock_limit_bytes": (_OPT_INT, True),
    "shm_bytes": (_INT, True),
    "cgroup_usage_bytes": (_OPT_INT, False),
}
_DISK_FIELDS: _Spec = {
    "mount": ((str,), True),
    "device": ((str,), True),
    "fs_type": ((str,), True),
    "total_bytes": (_INT, True),
    "free_bytes": (_INT, True),
    "rotational": (_OPT_BOOL, True),
    "nvme": ((bool,), True),
    "odirect": (_OPT_BOOL, True),
    "writable": ((bool,), False),
    "is_tmpfs": ((bool,), False),
    "is_overlay": ((bool,), False),
    "is_network": ((bool,), False),
}


_MAX_INT = (1 << 63) - 1  # byte counts the kernel reports are 64-bit
_MAX_STR = 4096  # PATH_MAX
_MAX_ITEMS = 1 << 16  # GPUs, disks, CPUs
_MAX_FILE_BYTES = 16 << 20


def _list(value: Any, source: str, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise SnapshotError(f"{source}: '{key}' must be a list")
    if len(value) > _MAX_ITEMS:
        raise SnapshotError(f"{source}: '{key}' has more than {_MAX_ITEMS} entries")
    return value


def _take(obj: Any, source: str, where: str, spec: _Spec) -> dict[str, Any]:
    if not isinstance(obj, Mapping):
        raise SnapshotError(f"{source}: '{where}' must be an object")
    out: dict[str, Any] = {}
    for name, (types, required) in spec.items():
        if name not in obj:
            if required:
                raise SnapshotError(f"{source}: missing key '{where}.{name}'")
            continue
        value = obj[name]
        # bool is an int subclass: refuse True where a byte count is expected.
        if isinstance(value, bool) and bool not in types:
            raise SnapshotError(f"{source}: '{where}.{name}' must be {_describe(types)}, got {value!r}")
        if not isinstance(value, types):
            raise SnapshotError(f"{source}: '{where}.{name}' must be {_describe(types)}, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= _MAX_INT:
            raise SnapshotError(f"{source}: '{where}.{name}' must be from 0 to 2^63-1, got {str(value)[:30]}")
        if isinstance(value, str) and len(value) > _MAX_STR:
            raise SnapshotError(f"{source}: '{where}.{name}' is longer than {_MAX_STR} characters")
        out[name] = value
    return out


def _describe(types: tuple[type, ...]) -> str:
    names = {int: "an integer", str: "a string", bool: "true/false", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)
