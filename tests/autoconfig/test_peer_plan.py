"""The peer tier's transport comes from the RDMA devices the probe finds under /sys/class/infiniband."""
from __future__ import annotations

import os
from pathlib import Path

from autoconfig.plan.peer import pick_transport
from autoconfig.probe import probe_rdma_drivers
from autoconfig.probe.snapshot import HostSnapshot


def fake_device(sys_root: Path, name: str, driver: str) -> None:
    drivers = sys_root / "bus" / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    device = sys_root / "devices" / name
    device.mkdir(parents=True)
    os.symlink(drivers, device / "driver")
    ib = sys_root / "class" / "infiniband"
    ib.mkdir(parents=True, exist_ok=True)
    os.symlink(sys_root / "devices" / name, ib / name)
    (device / "device").symlink_to(device)  # /sys/class/infiniband/<dev>/device/driver


def test_the_probe_reads_each_devices_driver(tmp_path: Path) -> None:
    assert probe_rdma_drivers(str(tmp_path)) == []
    fake_device(tmp_path, "rdmap0s6", "efa")
    fake_device(tmp_path, "mlx5_0", "mlx5_core")
    assert probe_rdma_drivers(str(tmp_path)) == ["mlx5_core", "efa"]


def test_efa_wins_then_rdma_then_tcp() -> None:
    assert pick_transport(["mlx5_core", "efa"])[0] == "efa"
    assert pick_transport(["mlx5_core"])[0] == "rdma"
    assert pick_transport([]) == ("tcp", "no RDMA or EFA device under /sys/class/infiniband")


def test_snapshots_without_the_field_still_load_and_round_trip() -> None:
    data = HostSnapshot(rdma_drivers=["efa"]).to_dict()
    assert HostSnapshot.from_dict(data).rdma_drivers == ["efa"]
    del data["rdma_drivers"]
    assert HostSnapshot.from_dict(data).rdma_drivers == []


def test_start_up_checks_the_holder_store_of_its_own_once() -> None:
    from autoconfig.probe.remote_store import remote_store_messages
    from lmi_cache.devtools.redis_server import RedisServer, free_port

    def messages(**settings: object) -> list[str]:
        return remote_store_messages({"chunk_size": 256, "enable_p2p": True, **settings}, None, {}, timeout_s=0.5)

    with RedisServer() as server:
        assert messages(extra_config={"peer_holders_url": server.url}) == [
            f"note: peer holder store: the redis store {server.url} answers"]
        both = messages(remote_url=server.url, extra_config={"peer_holders_url": server.url})
        assert [m.split(":")[1] for m in both] == [" remote tier", " peer holder store"]
        assert len(messages(remote_url=server.url)) == 1  # the records live in the remote tier's store
    down = messages(extra_config={"peer_holders_url": f"redis://127.0.0.1:{free_port()}"})
    assert len(down) == 1 and down[0].startswith("warning: peer holder store: ")
    assert down[0].endswith("the server starts anyway (peers are found by routers' hints only until the store answers)")
