"""Probe NVIDIA GPUs through NVML (autoconfig probe, CLI process).

``pynvml`` (package ``nvidia-ml-py``) is optional: on a CPU host, in a
container started without the driver, or with no devices, the answer is an
empty list, a normal result rather than an error. NVML sees every GPU the
container was given; ``CUDA_VISIBLE_DEVICES`` narrows that to what vLLM will
see, so we apply it too and number devices as CUDA will.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from autoconfig.probe.snapshot import GpuInfo

log = logging.getLogger(__name__)


def probe_gpus(env: Mapping[str, str] | None = None) -> list[GpuInfo]:
    """Visible GPUs with name and total/free memory; ``[]`` when NVML is unusable."""
    try:
        import pynvml  # optional dependency, only needed on GPU hosts
    except ImportError:
        log.debug("pynvml not installed: reporting no GPUs")
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        log.debug("NVML unavailable (%s): reporting no GPUs", err)
        return []
    try:
        return _list_devices(pynvml, os.environ if env is None else env)
    except pynvml.NVMLError as err:
        log.warning("NVML failed while listing GPUs (%s): reporting no GPUs", err)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            log.debug("nvmlShutdown failed: %s", err)


def _list_devices(nvml: Any, env: Mapping[str, str]) -> list[GpuInfo]:
    count = int(nvml.nvmlDeviceGetCount())
    handles = [_handle(nvml, i) for i in range(count)]
    selected = _apply_visible_devices(nvml, handles, env.get("CUDA_VISIBLE_DEVICES"))
    gpus: list[GpuInfo] = []
    for handle in selected:
        if handle is None:
            continue
        try:
            name = _text(nvml.nvmlDeviceGetName(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as err:
            # One bad device (fallen off the bus, in reset) should not hide the others.
            log.warning("skipping a GPU that NVML cannot query: %s", err)
            continue
        gpus.append(GpuInfo(
            index=len(gpus),
            name=name,
            memory_total_bytes=int(memory.total),
            memory_free_bytes=int(memory.free),
        ))
    return gpus


def _handle(nvml: Any, index: int) -> Any:
    """The device handle, or None for a device NVML cannot open (kept to preserve CUDA numbering)."""
    try:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as err:
        log.warning("skipping GPU %d: NVML cannot open it: %s", index, err)
        return None


def _apply_visible_devices(nvml: Any, handles: list[Any], visible: str | None) -> list[Any]:
    """Handles in CUDA_VISIBLE_DEVICES order; CUDA stops at the first entry it cannot match."""
    if visible is None:
        return handles
    selected: list[Any] = []
    uuids: list[str] | None = None
    for raw in visible.split(","):
        item = raw.strip()
        if not item:
            break
        if item.isdigit():
            index = int(item)
            if index >= len(handles):
                break
            selected.append(handles[index])
            continue
        if item.startswith("MIG-"):
            # MIG instances are not whole devices; sizing them is out of our reach here.
            log.debug("CUDA_VISIBLE_DEVICES names MIG devices: reporting all GPUs")
            return handles
        if uuids is None:
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) if h is not None else "" for h in handles]
        # CUDA accepts any unique prefix of a GPU UUID.
        matches = [h for h, uuid in zip(handles, uuids) if uuid.startswith(item)]
        if len(matches) != 1:
            break
        selected.append(matches[0])
    return selected


def _text(value: Any) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
