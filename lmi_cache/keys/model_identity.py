"""The identity of the weights vLLM serves, for the cache key namespace (torch-free; scheduler and worker).

KV depends on the weights, not on the path they are served from: a fine-tune
redeployed at the same ``/opt/ml/model`` must never reuse the chunks the
previous weights left on disk. The identity is, in order of preference:

1. ``LMI_CACHE_MODEL_VERSION`` (env), for users who version models
   themselves: used as given, nothing is read;
2. the Hugging Face commit hash, when the model is a snapshot of a Hugging Face
   cache (``.../models--org--name/snapshots/<hash>``) or a hub id whose ref
   (``main`` or the requested revision) the local cache records;
3. for any other local directory or file, a content fingerprint: every
   config/tokenizer/code file hashed whole (sampled when larger than
   ``_WHOLE_FILE_MAX_BYTES``) and every weight file by its size, its first
   64 KiB (the safetensors header) and ``_SAMPLED_PAGES`` pages spread evenly
   over the file plus the last page. A few hundred KiB per weight file, never
   a full read; a new set of weights changes every sampled page.

Sampling cannot see a change confined to bytes between the sampled pages (a
fine-tune touching one small tensor): such deployments should set
``LMI_CACHE_MODEL_VERSION``. File modification times are deliberately left
out, so a model copied again unchanged (every container start on SageMaker)
keeps its cache.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import xxhash

from lmi_cache.errors import ConfigError

logger = logging.getLogger(__name__)

MODEL_VERSION_ENV = "LMI_CACHE_MODEL_VERSION"
_MAX_VERSION_CHARS = 256
_PAGE_BYTES = 4096
_HEAD_BYTES = 64 * 1024
_SAMPLED_PAGES = 32
_WHOLE_FILE_MAX_BYTES = 4 * 1024 * 1024
_MAX_FILES = 4096  # a model directory with more entries than this is not a model directory
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# Files that decide what the model computes (weights, architecture, tokenizer, remote code);
# serving.properties, YAML, READMEs and lock files in the model directory do not.
_MODEL_SUFFIXES = (
    ".json", ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".model", ".tiktoken", ".py", ".txt",
)


def model_identity(
    model: str,
    *,
    revision: str | None = None,
    cache_dirs: Sequence[str | os.PathLike[str]] = (),
    env: dict[str, str] | None = None,
) -> str:
    """A short string that changes when the served weights change (see the module docstring).

    ``model`` is vLLM's ``model_config.model`` (a path or a hub id), ``revision``
    vLLM's requested revision, ``cache_dirs`` extra Hugging Face cache roots
    (vLLM's ``--download-dir``) searched before the default one. ConfigError for
    a malformed ``LMI_CACHE_MODEL_VERSION``.
    """
    environ = os.environ if env is None else env
    override = environ.get(MODEL_VERSION_ENV)
    if override is not None and override.strip():
        return "user:" + _checked_version(override)
    path = Path(model).expanduser()
    if path.exists():
        commit = _snapshot_commit(path)
        if commit is not None:
            return f"hf:{commit}"
        return "content:" + content_fingerprint(path)
    commit = _hub_commit(model, revision, cache_dirs)
    if commit is not None:
        return f"hf:{commit}"
    logger.warning(
        "lmi-cache: cannot tell which weights %r are (no local path, no Hugging Face cache ref); persisted KV "
        "is keyed by name and revision only: set %s when you replace the weights", model, MODEL_VERSION_ENV,
    )
    return f"name:{model}@{revision or 'default'}"


def served_model_identity(model_config: Any, download_dir: str | None = None) -> str:
    """``model_identity`` of vLLM's ``model_config``, plus the vLLM settings that change what the same
    files compute: the weights' dtype (with an fp8 KV cache the KV dtype alone hides it), quantization,
    and config overrides such as rope scaling."""
    identity = model_identity(
        str(model_config.model),
        revision=getattr(model_config, "revision", None),
        cache_dirs=[download_dir] if download_dir else [],
    )
    identity += f"|dtype={str(getattr(model_config, 'dtype', '')).removeprefix('torch.')}"
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        identity += f"|quantization={quantization}"
    overrides = getattr(model_config, "hf_overrides", None)
    if isinstance(overrides, dict) and overrides:
        canonical = json.dumps(overrides, sort_keys=True, default=str).encode()
        identity += "|overrides=" + xxhash.xxh64_hexdigest(canonical)
    return identity


def _checked_version(value: str) -> str:
    version = value.strip()
    if len(version) > _MAX_VERSION_CHARS or not version.isprintable():
        raise ConfigError(
            f"env {MODEL_VERSION_ENV}: expected a printable version label of at most {_MAX_VERSION_CHARS} "
            f"characters (e.g. a commit hash or a release tag), got {value[:40]!r}"
        )
    return version


def _snapshot_commit(path: Path) -> str | None:
    """The commit hash when ``path`` is a Hugging Face cache snapshot (or a file in one)."""
    resolved = path.resolve()
    folder = resolved if resolved.is_dir() else resolved.parent
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        if _COMMIT_RE.match(folder.name):
            return folder.name
    return None


def _hub_commit(model_id: str, revision: str | None, cache_dirs: Sequence[str | os.PathLike[str]]) -> str | None:
    if revision is not None and _COMMIT_RE.match(revision):
        return revision
    if model_id.count("/") > 1 or not model_id.strip("/"):
        return None
    folder = "models--" + model_id.replace("/", "--")
    for root in [*cache_dirs, *_default_hub_caches()]:
        ref = Path(root) / folder / "refs" / (revision or "main")
        try:
            commit = ref.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if _COMMIT_RE.match(commit):
            return commit
    return None


def _default_hub_caches() -> list[str]:
    try:
        from huggingface_hub import constants

        return [str(constants.HF_HUB_CACHE)]
    except Exception:  # noqa: BLE001 - huggingface_hub missing or broken: use its documented default
        home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
        return [os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub"))]


def content_fingerprint(path: str | os.PathLike[str]) -> str:
    """Hex XXH3-128 of a model directory's (or file's) model files, sampled as described above."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(_model_files(root))
    digest = xxhash.xxh3_128()
    for file in files:
        digest.update(file.name.encode("utf-8", "surrogateescape") + b"\0")
        _hash_file(file, digest)
    return digest.hexdigest()


def _model_files(root: Path) -> Iterable[Path]:
    count = 0
    for entry in os.scandir(root):
        if entry.name.startswith(".") or not entry.name.endswith(_MODEL_SUFFIXES):
            continue
        if entry.is_file():  # follows symlinks: model folders are often links into a blob store
            count += 1
            if count > _MAX_FILES:
                break
            yield Path(entry.path)


def _hash_file(path: Path, digest: xxhash.xxh3_128) -> None:
    """Feed the file's size and its sampled (or whole) bytes into ``digest``; unreadable = its error name."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        digest.update(f"unreadable:{err.errno}".encode())
        return
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            digest.update(b"not-a-file")
            return
        size = info.st_size
        digest.update(size.to_bytes(8, "little"))
        for offset, length in sample_ranges(size):
            digest.update(os.pread(fd, length, offset))
    except OSError as err:
        digest.update(f"unreadable:{err.errno}".encode())
    finally:
        os.close(fd)


def sample_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) pairs read from a file of ``size`` bytes: all of it when small."""
    if size <= _WHOLE_FILE_MAX_BYTES:
        return [(0, size)]
    last_page = (size - 1) // _PAGE_BYTES * _PAGE_BYTES
    ranges = [(0, _HEAD_BYTES)]
    for i in range(1, _SAMPLED_PAGES + 1):
        offset = (size * i // (_SAMPLED_PAGES + 1)) // _PAGE_BYTES * _PAGE_BYTES
        ranges.append((offset, _PAGE_BYTES))
    ranges.append((last_page, size - last_page))
    return ranges
