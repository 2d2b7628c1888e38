"""What a chunk key covers besides the token ids: the one key rule for every input that changes the KV.

Torch-free and vLLM-free (scheduler process): reads vLLM's ``Request`` by
attribute, so tests drive it with plain objects. The rule mirrors what vLLM's
own block hash covers (``vllm/v1/core/kv_cache_utils.py``
``generate_block_hash_extra_keys``), hashed our way so that keys stay the same
in every process on every machine:

* token ids: the prompt's (``[0] * n`` for a prompt given only as embeddings,
  as vLLM's ``all_token_ids``), chained chunk by chunk (``hashing``);
* multimodal items: each item's ``identifier`` from ``request.mm_features``
  (vLLM's content hash of the image/audio, LoRA-prefixed when the encoder has
  LoRA), its modality and its placeholder range relative to the chunk, in every
  chunk its placeholders overlap. Chunks before an item's first placeholder
  carry nothing of it, so the text before an image keeps its keys; the chain
  carries the item into every later chunk;
* prompt embeddings: a hash of the chunk's embedding rows (and, for a prompt
  mixing ids and embeddings, of which positions are ids);
* the LoRA adapter: its name and a hash of its files' content (``AdapterIdentities``),
  so an adapter replaced in place under the same name is a miss (and not
  cached at all while vLLM may still compute with the old files);
* ``cache_salt``: in the request's seed.

The model, its weights, KV dtype, layout, rank and KV cache group are in the
``KeySpace`` (``hashing``). :class:`KeyRule` reads them from a request; a
request whose inputs cannot be named safely gets no keys at all (never
cached): multimodal items when vLLM names them per request instead of by
content (``KeyRule.mm_ids_are_content``).
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

_READ_BYTES = 8 << 20


@dataclass(frozen=True)
class MultimodalItem:
    """One image/audio/video item of a prompt: vLLM's identifier and its placeholder tokens."""

    identifier: str
    modality: str
    offset: int  # first placeholder token
    length: int  # placeholder tokens


@dataclass(frozen=True)
class PromptEmbeds:
    """A prompt's embeddings as bytes, one row per prompt position (and which positions are token ids)."""

    data: memoryview
    row_bytes: int
    dtype: str
    is_token_ids: bytes | None = None  # one byte per position in a mixed prompt; None: every position embedded

    def chunk_digest(self, start: int, end: int) -> str:
        digest = xxhash.xxh3_128(self.data[start * self.row_bytes : end * self.row_bytes])
        if self.is_token_ids is not None:
            digest.update(self.is_token_ids[start:end])
        return digest.hexdigest()


@dataclass(frozen=True)
class KeyInputs:
    """Everything of one request that its chunk keys cover (see the module docstring)."""

    tokens: Sequence[int]
    adapter: str | None = None  # adapter identity (name + content hash); None: the base model
    cache_salt: str | None = None
    mm_items: tuple[MultimodalItem, ...] = ()
    embeds: PromptEmbeds | None = None
    uncacheable: str | None = None  # why this request gets no keys; None: it is cached

    @property
    def is_plain_text(self) -> bool:
        """Token ids alone describe the KV (no multimodal items, no embeddings)."""
        return not self.mm_items and self.embeds is None

    def chunk_extra(self, start: int, end: int) -> bytes:
        """16 bytes that the chunk [start, end) adds to its token ids, or b"" when it holds nothing else."""
        parts: list[list[Any]] = [
            ["mm", item.modality, item.identifier, item.offset - start, item.length]
            for item in self.mm_items
            if item.offset < end and item.offset + item.length > start
        ]
        if self.embeds is not None:
            parts.append(["embeds", self.embeds.dtype, self.embeds.row_bytes, self.embeds.chunk_digest(start, end)])
        if not parts:
            return b""
        return xxhash.xxh3_128_digest(json.dumps(parts, separators=(",", ":")).encode("utf-8"))


def _prompt_embeds(request: Any) -> PromptEmbeds | None:
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return None
    array = _as_bytes_array(embeds)
    rows = int(array.shape[0]) if array.ndim else 0
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    mask = getattr(request, "prompt_is_token_ids", None)
    is_token_ids = None if mask is None else np.asarray(_as_bytes_array(mask), dtype=np.uint8).tobytes()
    return PromptEmbeds(data.data, data.size // rows if rows else 0, str(getattr(embeds, "dtype", array.dtype)),
                        is_token_ids)


def _as_bytes_array(value: Any) -> np.ndarray:
    """A numpy view of a numpy array, a list or a CPU torch tensor (bf16 as its raw 16-bit words)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):
        tensor = value.detach().cpu().contiguous()
        if getattr(tensor, "element_size", lambda: 0)() == 2 and "float" in str(tensor.dtype):
            import torch  # only for a tensor, which only a vLLM process hands in

            tensor = tensor.view(torch.int16)  # numpy has no bfloat16
        return tensor.numpy()
    return np.asarray(value)


@dataclass
class AdapterIdentities:
    """LoRA adapter -> "name@content-hash": the weights vLLM computes with, as far as the files tell.

    vLLM reads an adapter's files when it loads the adapter under an id
    (``lora_int_id``) and keeps those weights while the id is in use; a reload
    (a new id, a new process) reads the files again. So an adapter is hashed the
    first time its (path, id) is seen, and that hash names it while its files
    stay as they were: every file's (name, size, mtime), checked per request (a
    few ``stat`` calls), never hashed again. Files changed under an id already
    seen leave it unknown which weights vLLM computes with: ``identity`` is None
    (such requests get no keys) until the adapter is loaded under a new id. An
    adapter whose path is not a local directory or file is named by its name and
    path, as vLLM's own block hash does.
    """

    _known: dict[tuple[str, int], tuple[tuple[Any, ...], str]] = field(default_factory=dict)
    _changed: set[tuple[str, int]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def identity(self, lora_request: Any) -> str | None:
        name = str(getattr(lora_request, "lora_name", "") or "")
        path = str(getattr(lora_request, "lora_path", "") or getattr(lora_request, "path", "") or "")
        version = _version(path) if path else None
        if version is None:
            return f"{name}@path:{path}"
        key = (path, int(getattr(lora_request, "lora_int_id", 0) or 0))
        with self._lock:
            known = self._known.get(key)
        if known is not None:
            if known[0] == version:
                return f"{name}@{known[1]}"
            if key not in self._changed:
                self._changed.add(key)
                logger.warning("lmi-cache: the files of adapter %s (%s) changed while vLLM has it loaded; its requests "
                               "are not cached until it is loaded again", name, path)
            return None
        content = _content_hash(path, version)
        with self._lock:
            self._known.setdefault(key, (version, content))
        logger.info("lmi-cache: adapter %s (%s) keyed by its content %s", name, path, content[:16])
        return f"{name}@{content}"


def _files(path: str) -> list[Path]:
    root = Path(path)
    if root.is_file():
        return [root]
    return sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))


def _version(path: str) -> tuple[Any, ...] | None:
    try:
        return tuple((p.name, st.st_size, st.st_mtime_ns) for p in _files(path) for st in [p.stat()])
    except OSError:
        return None


def _content_hash(path: str, version: tuple[Any, ...]) -> str:
    """XXH3-128 over every file's name and whole content (adapters are small: about 1 s per GB, once)."""
    digest = xxhash.xxh3_128()
    for file in _files(path):
        digest.update(file.name.encode("utf-8", "surrogateescape") + b"\0")
        try:
            with open(file, "rb", buffering=0) as handle:
                while block := handle.read(_READ_BYTES):
                    digest.update(block)
        except OSError as err:  # vanished or unreadable: a name no other version has
            digest.update(f"unreadable:{err.errno}:{version}".encode())
        digest.update(b"\0")
    return digest.hexdigest()


_PROCESS_ADAPTERS = AdapterIdentities()  # every KeyRule of a process shares it: each adapter version is hashed once


@dataclass
class KeyRule:
    """Reads a request's key inputs; one per scheduler (the adapter hashes are shared by the whole process)."""

    # Whether vLLM names multimodal items by their content: it does unless both its prefix cache and its
    # processor cache are off (``environment_trusts_mm_ids``); then it names them per request, and a request
    # with such items is not cached (another process could reuse the same names for other images).
    mm_ids_are_content: bool = True
    adapters: AdapterIdentities = field(default_factory=lambda: _PROCESS_ADAPTERS)

    def inputs(self, request: Any) -> KeyInputs:
        """The key inputs of vLLM's ``Request`` (read by attribute)."""
        tokens: Sequence[int] | None = getattr(request, "prompt_token_ids", None)
        embeds = _prompt_embeds(request)
        if tokens is None:
            tokens = [0] * (int(getattr(request, "num_prompt_tokens", 0) or 0) if embeds is not None else 0)
        lora = getattr(request, "lora_request", None)
        items = tuple(
            MultimodalItem(str(f.identifier), str(getattr(f, "modality", "")), int(f.mm_position.offset),
                           int(f.mm_position.length))
            for f in getattr(request, "mm_features", None) or ()
        )
        adapter = self.adapters.identity(lora) if lora is not None else None
        uncacheable = None
        if items and not self.mm_ids_are_content:
            uncacheable = "vLLM names its multimodal items per request (prefix caching and its processor cache are off)"
        elif lora is not None and adapter is None:
            uncacheable = "the adapter's files changed while vLLM has it loaded"
        return KeyInputs(tokens, adapter, getattr(request, "cache_salt", None) or None, items, embeds, uncacheable)


def environment_trusts_mm_ids(vllm_config: Any) -> bool:
    """Whether vLLM names multimodal items by content (``KeyRule.mm_ids_are_content``) in this deployment."""
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "enable_prefix_caching", False):
        return True
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    return mm is None or float(getattr(mm, "mm_processor_cache_gb", 0) or 0) > 0
