"""LoRA adapters LMI's way: the model directory's ``adapters/`` folder, checked at start, loaded on first use.

``scan_adapters`` is pure file reading (no torch, no vLLM): ``lmi-cache serve``
calls it before vLLM starts to print what it registered, and the front
middleware calls it again in vLLM's API server process to build its registry.
Layout as djl-serving ``serving/docs/adapters.md`` ("Adapters local
directory"): ``<model dir>/adapters/<name>/`` in PEFT's format
(``adapter_config.json`` + ``adapter_model.safetensors``). An adapter that
fails the checks is refused at registration: requests naming it get 424
(LMI's status for a failed adapter registration) with the reason, instead of
failing inside the engine. Good adapters are handed to vLLM through a
``LoRAResolver`` (``lmi_cache.vllm_connector.front_glue``: this package
imports no vLLM), so vLLM loads one only when a request first names it.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTERS_DIR_ENV = "LMI_CACHE_ADAPTERS_DIR"
MAX_LORA_RANK_ENV = "LMI_CACHE_MAX_LORA_RANK"
HIDDEN_SIZE_ENV = "LMI_CACHE_MODEL_HIDDEN_SIZE"
VLLM_DEFAULT_MAX_LORA_RANK = 16  # vLLM's LoRAConfig.max_lora_rank default (vllm/config/lora.py)
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int = 0
    error: str | None = None  # why registration refused it

    @property
    def ok(self) -> bool:
        return self.error is None


def _safetensors_header(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise ValueError("truncated (no safetensors header)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError("not a safetensors file (header length past the end)")
        header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (header is not an object)")
    end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ValueError(f"truncated: tensors need {8 + length + end} bytes, the file has {size}")
    return header


def check_adapter(path: Path, max_rank: int, hidden_size: int | None) -> int:
    """The adapter's rank; raise ValueError saying what is wrong with the folder."""
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError("no adapter_config.json (PEFT layout expected)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"adapter_config.json is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError("adapter_config.json is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"adapter_config.json r={rank!r}: expected a positive integer")
    if rank > max_rank:
        raise ValueError(f"rank {rank} exceeds max_lora_rank={max_rank}; raise option.max_lora_rank")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        if (path / "adapter_model.bin").is_file():
            return rank  # pickled weights: vLLM checks them when it loads the adapter
        raise ValueError("no adapter_model.safetensors")
    try:
        header = _safetensors_header(weights)
    except (OSError, ValueError) as err:
        raise ValueError(f"adapter_model.safetensors: {err}") from None
    lora_a = {k: v for k, v in header.items() if k.endswith("lora_A.weight")}
    if not lora_a:
        raise ValueError("adapter_model.safetensors holds no lora_A weights")
    for key, tensor in lora_a.items():
        shape = tensor.get("shape") or []
        if len(shape) != 2 or shape[0] != rank:
            raise ValueError(f"{key} has shape {shape}, expected [{rank}, in_features] for r={rank}")
        is_attention_input = any(f".{p}." in key for p in ("q_proj", "k_proj", "v_proj"))
        if hidden_size and is_attention_input and shape[1] != hidden_size:
            raise ValueError(f"{key} expects inputs of {shape[1]} features but the model's hidden_size "
                             f"is {hidden_size}: the adapter was trained for another base model")
    return rank


def scan_adapters(adapters_dir: Path, max_rank: int = VLLM_DEFAULT_MAX_LORA_RANK,
                  hidden_size: int | None = None) -> dict[str, Adapter]:
    """Every sub-folder of ``adapters_dir`` by name, each either registered (ok) or refused (error)."""
    found: dict[str, Adapter] = {}
    if not adapters_dir.is_dir():
        return found
    for entry in sorted(adapters_dir.iterdir()):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        try:
            rank = check_adapter(entry, max_rank, hidden_size)
        except ValueError as err:
            found[entry.name] = Adapter(entry.name, entry, error=str(err))
        else:
            found[entry.name] = Adapter(entry.name, entry, rank=rank)
    return found


def model_config_int(model_dir: Path, key: str) -> int | None:
    """An integer of the base model's config.json (its text_config for multimodal models), when readable."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    nested = config.get("text_config")
    value = (nested if isinstance(nested, dict) else config).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def model_hidden_size(model_dir: Path) -> int | None:
    """The base model's hidden_size from config.json, when it can be read."""
    return model_config_int(model_dir, "hidden_size")


def registry_from_env(env: dict[str, str] | None = None) -> dict[str, Adapter]:
    """The registry the front middleware serves, from what ``lmi-cache serve`` exported."""
    env = dict(os.environ) if env is None else env
    folder = env.get(ADAPTERS_DIR_ENV)
    if not folder:
        return {}
    return scan_adapters(Path(folder), *registry_limits(env))


def registry_limits(env: dict[str, str] | None = None) -> tuple[int, int | None]:
    """(max_lora_rank, the base model's hidden_size or None), as serve exported them."""
    env = dict(os.environ) if env is None else env
    raw_rank, hidden = env.get(MAX_LORA_RANK_ENV, ""), env.get(HIDDEN_SIZE_ENV, "")
    return (int(raw_rank) if raw_rank.isdigit() else VLLM_DEFAULT_MAX_LORA_RANK,
            int(hidden) if hidden.isdigit() else None)
