"""Runs probe_host() on the real machine: the snapshot must be sane and survive the JSON contract."""
from __future__ import annotations

import json
import os
import time

from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.probe import probe_host
from autoconfig.probe.disks import disk_for_path


def test_real_probe_round_trips_and_is_sane() -> None:
    started = time.perf_counter()
    snap = probe_host()
    elapsed_s = time.perf_counter() - started

    back = HostSnapshot.from_dict(json.loads(json.dumps(snap.to_dict())), source="probe")
    assert back == snap
    assert snap.memory.total_bytes > 0
    assert 0 < snap.memory.available_bytes <= snap.memory.total_bytes
    assert snap.cpu_count == len(os.sched_getaffinity(0))
    root = [d for d in snap.disks if d.mount == "/"]
    assert len(root) == 1 and root[0].total_bytes > 0
    assert disk_for_path(snap.disks, "/tmp") is not None
    assert len({(d.mount) for d in snap.disks}) == len(snap.disks)
    # autoconfig runs at every container start: the probe must stay cheap.
    assert elapsed_s < 1.0, f"probe_host took {elapsed_s:.2f}s"
