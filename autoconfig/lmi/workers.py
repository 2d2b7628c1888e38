"""LMI's server keys (no ``option.`` prefix): where workers run, how many, and misspelt prefixes.

Read at container start by ``autoconfig.lmi.properties``. DJL Serving (LMI's model
server) reads ``load_on_devices`` (the GPU each worker starts on) and
``maxWorkers``/``gpu.maxWorkers``; LMI starts as many workers as the GPUs hold
(serving/docs/lmi/deployment_guide/configurations.md in deepjavalibrary/djl-serving)
and one when LMCache is on (lmcache_user_guide.md). vLLM's data parallelism
stands in for LMI's workers. A key that looks like a misspelt ``option.`` key
is an error, not a silent no-op. Pure.
"""
from __future__ import annotations

import difflib
from typing import Mapping

from autoconfig.lmi.names import SERVER_KEYS
from lmi_cache.errors import UserError


class ServerKeyError(UserError):
    """A bad LMI server key in serving.properties (names the file and key)."""


def canonical_name(name: str) -> str:
    """``option.Tensor.Parallel-Degree`` and ``OPTION_TENSOR_PARALLEL_DEGREE`` name one setting (after the prefix)."""
    return name.strip().lower().replace(".", "_").replace("-", "_")


def default_replicas(model_gpus: int, gpu_count: int, cache_on: bool, file_props: Mapping[str, str],
                      notes: list[str]) -> int:
    """LMI's number of model copies when option.data_parallel_degree is unset.

    LMI starts as many workers as the GPUs hold (configurations.md), limited by
    ``maxWorkers``/``gpu.maxWorkers`` and the devices in ``load_on_devices``;
    with LMCache on it runs one worker (lmcache_user_guide.md), which we follow.
    """
    fit = gpu_count // model_gpus
    if fit <= 1:
        return 1
    if cache_on:
        notes.append(f"one model copy on {model_gpus} of {gpu_count} GPUs: LMI runs one worker when LMCache is on; "
                     "set option.data_parallel_degree to serve more replicas, each with its own tiers")
        return 1
    limit = fit
    for key in ("maxWorkers", "gpu.maxWorkers"):
        value = file_props.get(key, "").strip()
        if value.isdigit() and int(value) >= 1:
            limit = min(limit, int(value))
    if limit > 1:
        notes.append(f"data parallel: {limit} replicas x {model_gpus} GPU(s) on {gpu_count} GPUs (LMI's default: "
                     "as many model copies as the GPUs hold; set option.data_parallel_degree=1 for one)")
    return limit


def lmi_devices(file_props: Mapping[str, str], source: str, gpu_count: int | None) -> list[int] | None:
    """LMI's ``load_on_devices`` (``0`` or ``0;4``; ``*`` = all): the GPU each worker starts on, or None for all."""
    raw = file_props.get("load_on_devices", file_props.get("load_on_device", "")).strip()
    if not raw or raw == "*" or not gpu_count:
        return None
    try:
        devices = sorted({int(d) for d in raw.replace(",", ";").split(";") if d.strip()})
    except ValueError:
        raise ServerKeyError(f"{source}: load_on_devices={raw!r}: expected * or GPU indices such as 0;1") from None
    if not devices or devices[0] < 0 or devices[-1] >= gpu_count:
        raise ServerKeyError(f"{source}: load_on_devices={raw!r}: this host has GPUs 0-{gpu_count - 1}")
    return devices


def worker_gpus(starts: list[int], model_gpus: int, host_gpus: int, source: str) -> list[int]:
    """The GPUs the workers starting at ``starts`` occupy, ``model_gpus`` each (LMI's load_on_devices)."""
    gpus = [g for start in starts for g in range(start, start + model_gpus)]
    if len(set(gpus)) != len(gpus) or gpus[-1] >= host_gpus:
        raise ServerKeyError(f"{source}: load_on_devices={';'.join(map(str, starts))}: workers of {model_gpus} GPU(s) "
                              f"starting there need GPUs {', '.join(map(str, gpus))}, this host has 0-{host_gpus - 1}; "
                              "list fewer devices or lower tensor_parallel_degree")
    return gpus


def noted(key: str, notes: list[str]) -> bool:
    return any(n.startswith(f"{key}=") for n in notes)


def check_server_keys(file_props: Mapping[str, str], source: str) -> list[str]:
    """An un-prefixed key that looks like a misspelt ``option.`` key is an error, not a silent no-op.

    An exact engine name without the prefix (``rolling_batch=scheduler`` in
    LMI's own tests) is what LMI ignores too: a loud note, not an error.
    """
    from autoconfig.lmi.to_vllm import known_option_names

    known = known_option_names()
    notes: list[str] = []
    for key in file_props:
        if key.startswith("option.") or key in SERVER_KEYS:
            continue
        head, dot, rest = key.partition(".")
        name = canonical_name(rest if dot else key)
        if dot and difflib.get_close_matches(head.lower(), ["option"], n=1, cutoff=0.6):
            raise ServerKeyError(f"{source}: {key}: not an LMI key; did you mean option.{rest}?")
        if name in known:
            notes.append(f"{key}={file_props[key]} in {source} ignored: engine settings need the option. prefix "
                         f"(write option.{name} to set it)")
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            raise ServerKeyError(f"{source}: {key}: not an LMI key; did you mean option.{close[0]}?")
    return notes
