"""Tests for autoconfig.probe.gpus with a fake ``pynvml`` module injected through sys.modules."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from autoconfig.probe.snapshot import GpuInfo
from autoconfig.probe.gpus import probe_gpus

GIB = 1024**3


class FakeNVMLError(Exception):
    pass


@dataclass
class FakeDevice:
    name: Any  # str or bytes, as different nvidia-ml-py releases return
    total_bytes: int
    free_bytes: int
    uuid: str = ""
    broken: bool = False
    unopenable: bool = False


@dataclass
class FakeNvml:
    devices: list[FakeDevice] = field(default_factory=list)
    init_error: bool = False
    count_error: bool = False
    calls: list[str] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("pynvml")
        mod.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                     "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUUID"):
            setattr(mod, name, getattr(self, name))
        return mod

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error:
            raise FakeNVMLError("Driver Not Loaded")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        if self.devices[index].unopenable:
            raise FakeNVMLError("Unknown Error")
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: FakeDevice) -> Any:
        if handle.broken:
            raise FakeNVMLError("GPU is lost")
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=handle.total_bytes, free=handle.free_bytes,
                                     used=handle.total_bytes - handle.free_bytes)

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        return handle.uuid


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml) -> FakeNvml:
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake


def three_gpus() -> list[FakeDevice]:
    return [
        FakeDevice("NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB, "GPU-aaaa1111"),
        FakeDevice(b"NVIDIA H100 80GB HBM3", 80 * GIB, 40 * GIB, "GPU-bbbb2222"),
        FakeDevice("NVIDIA L4", 24 * GIB, 23 * GIB, "GPU-cccc3333"),
    ]


def test_missing_library_means_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes "import pynvml" raise ImportError
    assert probe_gpus(env={}) == []


def test_no_driver_means_no_gpus_and_no_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, FakeNvml(three_gpus(), init_error=True))
    assert probe_gpus(env={}) == []
    assert fake.calls == ["init"]


def test_zero_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, FakeNvml([]))
    assert probe_gpus(env={}) == []
    assert fake.calls == ["init", "shutdown"]


def test_all_devices_with_names_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, FakeNvml(three_gpus()))
    assert probe_gpus(env={}) == [
        GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB),
        GpuInfo(1, "NVIDIA H100 80GB HBM3", 80 * GIB, 40 * GIB),  # bytes name decoded
        GpuInfo(2, "NVIDIA L4", 24 * GIB, 23 * GIB),
    ]
    assert fake.calls == ["init", "shutdown"]


def test_nvml_error_while_listing_gives_no_gpus_and_still_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, FakeNvml(three_gpus(), count_error=True))
    assert probe_gpus(env={}) == []
    assert fake.calls == ["init", "shutdown"]


def test_one_broken_device_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = three_gpus()
    devices[0].broken = True
    install(monkeypatch, FakeNvml(devices))
    assert [(g.index, g.name, g.memory_free_bytes) for g in probe_gpus(env={})] == [
        (0, "NVIDIA H100 80GB HBM3", 40 * GIB),
        (1, "NVIDIA L4", 23 * GIB),
    ]


def test_device_that_cannot_be_opened_is_skipped_without_shifting_cuda_indices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    devices = three_gpus()
    devices[1].unopenable = True
    install(monkeypatch, FakeNvml(devices))
    assert [g.memory_free_bytes // GIB for g in probe_gpus(env={})] == [79, 23]
    assert [g.memory_free_bytes // GIB for g in probe_gpus(env={"CUDA_VISIBLE_DEVICES": "2"})] == [23]


@pytest.mark.parametrize(
    ("visible", "free_gib"),
    [
        ("2,0", [23, 79]),  # CUDA order, renumbered from 0
        ("1", [40]),
        ("", []),
        ("GPU-cccc", [23]),  # unique UUID prefix
        ("GPU-", []),  # ambiguous prefix: CUDA stops there
        ("0,7,1", [79]),  # CUDA ignores everything from the first bad entry
        ("MIG-0a1b2c", [79, 40, 23]),  # MIG slices: we report whole GPUs
    ],
)
def test_cuda_visible_devices_selects_and_orders(
    monkeypatch: pytest.MonkeyPatch, visible: str, free_gib: list[int]
) -> None:
    install(monkeypatch, FakeNvml(three_gpus()))
    gpus = probe_gpus(env={"CUDA_VISIBLE_DEVICES": visible})
    assert [g.memory_free_bytes // GIB for g in gpus] == free_gib
    assert [g.index for g in gpus] == list(range(len(free_gib)))


def test_environment_is_read_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNvml(three_gpus()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.memory_free_bytes for g in probe_gpus()] == [40 * GIB]
