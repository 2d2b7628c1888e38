"""Find a model's config.json (directory, file or Hugging Face id) and size its weights.

Run by autoconfig in the container-start process and by the CLI. Reads local
files only, unless the caller allows the network, in which case it fetches
config.json alone through huggingface_hub (imported lazily). The weights size
comes from the safetensors index, else the weight files, else an estimate
from the config (``autoconfig.model.params.estimate_num_params``).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from autoconfig.model.kv import KvLayoutInfo, ModelConfigError, kv_layout_from_config
from autoconfig.model.mistral import PARAMS_FILE, adapt_params
from autoconfig.model.params import bytes_per_param, estimate_num_params
from lmi_cache.errors import UserError, path_length_problem
from lmi_cache.plain_files import PlainFileError, read_text_file, refuse_json_constant

__all__ = ["ModelInfo", "ModelNotFoundError", "estimate_num_params", "hf_hub_cache_dir",
           "load_model_info", "read_config", "resolve_config_path"]


class ModelNotFoundError(UserError):
    """The model argument names no directory, file or locally cached Hugging Face model."""


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the HF id, or the directory name
    config_path: str
    kv: KvLayoutInfo
    weights_bytes: int
    weights_source: str  # how weights_bytes was found (one of three phrases, see _weights)
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict, repr=False)  # config.json as read (blending checks it)


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def load_model_info(
    model: str,
    *,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    hf_home: str | None = None,
    allow_network: bool = False,
    bf16_supported: bool = True,
) -> ModelInfo:
    """Resolve ``model``, read its config.json, derive the KV layout and the weights size."""
    config_path, name, notes = resolve_config_path(model, hf_home=hf_home, allow_network=allow_network)
    config = read_config(config_path)
    mistral_note = None
    if config_path.name == PARAMS_FILE:
        config = adapt_params(config, str(config_path))
        mistral_note = (f"{PARAMS_FILE} (Mistral format, no config.json) read as vLLM's config_format mistral maps it "
                        f"(configs/mistral.py adapt_config_dict): architecture "
                        f"{'/'.join(config.get('architectures', []))}, model_type {config.get('model_type')}")
    sidecar = config_path.parent / "hf_quant_config.json"
    if "quantization_config" not in config and sidecar.is_file():
        # vllm/transformers_utils/config.py: ModelOpt <= 0.29 keeps its quantization
        # config beside config.json, and vLLM reads it as quantization_config.
        config = {**config, "quantization_config": read_config(sidecar)}
        notes.append(f"quantization config read from {sidecar}")
    kv = kv_layout_from_config(config, kv_cache_dtype=kv_cache_dtype, dtype=dtype, source=str(config_path),
                               model_name=name, bf16_supported=bf16_supported)
    if mistral_note:
        kv.notes.insert(0, mistral_note)
    try:
        weights_bytes, weights_source = _weights(config_path.parent, config)
    except ModelConfigError as err:  # from the estimate, which does not know the file name
        raise ModelConfigError(f"{config_path}: {err}") from None
    return ModelInfo(name=name, config_path=str(config_path), kv=kv, weights_bytes=weights_bytes,
                     weights_source=weights_source, notes=notes, config=dict(config))


def hf_hub_cache_dir(hf_home: str | None = None) -> Path:
    """Where huggingface_hub keeps models: HF_HUB_CACHE, else $HF_HOME/hub, else the XDG default."""
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def resolve_config_path(model: str, *, hf_home: str | None = None,
                        allow_network: bool = False) -> tuple[Path, str, list[str]]:
    """(path of config.json, model name, notes) for a directory, a file or a HF model id."""
    too_long = path_length_problem(model)
    if too_long:
        raise ModelNotFoundError(f"model {model[:60]!r}...: {too_long}; pass a model directory, a config.json "
                                 "or a Hugging Face model id (org/name)")
    path = Path(model).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file() and (path / PARAMS_FILE).is_file():
            return path / PARAMS_FILE, path.resolve().name, []  # a Mistral-format model
        if not config.is_file():
            raise ModelNotFoundError(f"{path}: no config.json (or Mistral's params.json) in this directory; pass "
                                     "the model's directory (the one that holds config.json) or the config file itself")
        return config, path.resolve().name, []
    if path.is_file():
        return path, path.resolve().parent.name, []
    looks_like_path = model.startswith((".", "/", "~")) or model.count("/") > 1 or not _HF_ID.match(model)
    if looks_like_path:
        raise ModelNotFoundError(f"{model}: no such file or directory; pass a model directory, "
                                 "a config.json or a Hugging Face model id (org/name)")
    cache = hf_hub_cache_dir(hf_home)
    found = _from_hf_cache(cache, model)
    if found is not None:
        return found[0], model, found[1]
    if allow_network:
        return _download_config(model, hf_home), model, [f"config.json of {model} fetched from the Hugging Face Hub"]
    raise ModelNotFoundError(
        f"{model}: not in the local Hugging Face cache ({cache}); pass the model's directory "
        "(the one with config.json), or set HF_HOME / HF_HUB_CACHE to the cache that holds it"
    )


def _from_hf_cache(cache: Path, model_id: str) -> tuple[Path, list[str]] | None:
    repo = cache / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        try:
            revision = ref.read_bytes()[:200].decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            revision = ""
        config = _config_in(snapshots / revision) if re.fullmatch(r"[\w.-]+", revision) else None
        if config is not None:
            return config, [f"{model_id} resolved from the HF cache, refs/main = {revision}"]
    candidates = sorted((c for c in (_config_in(p) for p in snapshots.iterdir() if p.is_dir()) if c is not None),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    if not candidates:
        return None
    note = f"{model_id}: no usable refs/main in the HF cache; using the newest snapshot {candidates[0].parent.name}"
    return candidates[0], [note]


def _config_in(snapshot: Path) -> Path | None:
    """A snapshot's config.json, else its params.json (a Mistral-format model), else None."""
    for name in ("config.json", PARAMS_FILE):
        if (snapshot / name).is_file():
            return snapshot / name
    return None


def _download_config(model_id: str, hf_home: str | None) -> Path:
    try:
        from huggingface_hub import hf_hub_download  # optional: only for allow_network
    except ImportError:
        raise ModelNotFoundError(f"{model_id}: not cached locally and huggingface_hub is not installed; "
                                 "pip install huggingface_hub or pass the model's directory") from None
    unreachable = _hub_unreachable()
    if unreachable:  # fail in seconds, not after the hub client's minute of retries
        raise ModelNotFoundError(f"{model_id}: not in the local Hugging Face cache, and the Hub cannot be reached "
                                 f"({unreachable}); give a local directory with config.json instead (--model DIR, "
                                 "--model-dir DIR or option.model_id=DIR), or set HF_HOME to a cache that holds it")
    cache_dir = str(hf_hub_cache_dir(hf_home)) if hf_home else None
    try:
        return Path(hf_hub_download(repo_id=model_id, filename="config.json", cache_dir=cache_dir))
    except Exception as exc:  # the hub raises many types; the user needs one line
        first_error = exc
    if type(first_error).__name__ in _MISSING_FILE_ERRORS:
        try:  # a Mistral-format repository: params.json and no config.json
            return Path(hf_hub_download(repo_id=model_id, filename=PARAMS_FILE, cache_dir=cache_dir))
        except Exception:  # noqa: BLE001 - the config.json error below says what to fix
            pass
    first_line = (str(first_error).splitlines() or [type(first_error).__name__])[0]
    raise ModelNotFoundError(f"{model_id}: could not fetch config.json from the Hugging Face Hub "
                             f"({first_line}); check the id and HF_TOKEN, or pass a local directory")


# huggingface_hub's errors for a repository without the file asked for (by name: the import is optional).
_MISSING_FILE_ERRORS = frozenset({"EntryNotFoundError", "RemoteEntryNotFoundError", "LocalEntryNotFoundError"})


HUB_PROBE_TIMEOUT_S = 3.0


def _hub_unreachable() -> str | None:
    """Why the Hub (``HF_ENDPOINT``, default huggingface.co) cannot be reached now, from one short TCP connect."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except (OSError, ValueError) as err:
        return f"{host}: {getattr(err, 'strerror', None) or err or type(err).__name__}"
    return None


MAX_CONFIG_BYTES = 64 << 20  # config.json files are kilobytes; the largest safetensors indexes a few MiB
MAX_WEIGHTS_BYTES = 1 << 60  # 1 EiB: a total_size beyond this is corrupt


def read_config(path: Path) -> dict[str, Any]:
    """Parse a JSON object from ``path``; one-line ModelConfigError naming the file otherwise.

    Read as bytes and decoded here: bad encodings, NaN/Infinity literals, numbers too long
    to convert and nesting deeper than the parser allows each give one clear line.
    """
    try:
        text = read_text_file(str(path), MAX_CONFIG_BYTES, encoding="utf-8-sig")
    except PlainFileError as err:
        advice = "check the path and permissions" if err.kind in ("missing", "unreadable") else "pass the model's config.json"
        raise ModelConfigError(f"{path}: {err}; {advice}") from None
    try:
        data = json.loads(text, parse_constant=refuse_json_constant)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); "
                               "fix or re-download the file") from None
    except ValueError as exc:  # NaN/Infinity, or an integer literal over Python's digit limit
        why = str(exc) if "JSON literal" in str(exc) else "a number in it has too many digits to be a real value"
        raise ModelConfigError(f"{path}: {why}; fix or re-download the file") from None
    except RecursionError:
        raise ModelConfigError(f"{path}: JSON nested too deeply to be a model config; pass the model's config.json") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(data).__name__}; "
                               "pass the model's config.json")
    return data


def _weights(model_dir: Path, config: Mapping[str, Any]) -> tuple[int, str]:
    for index in sorted(model_dir.glob("*.safetensors.index.json"), key=lambda p: p.name != "model.safetensors.index.json"):
        try:
            total = read_config(index).get("metadata", {}).get("total_size")
        except (UserError, AttributeError):
            continue  # a broken index: fall back to the file sizes
        if isinstance(total, int) and not isinstance(total, bool) and 0 < total <= MAX_WEIGHTS_BYTES:
            return total, "safetensors index metadata.total_size"
    files = [p for p in model_dir.glob("*.safetensors")]
    if any(not p.name.startswith("consolidated") for p in files):
        files = [p for p in files if not p.name.startswith("consolidated")]  # Mistral ships both layouts
    if not files:
        files = [p for p in model_dir.glob("*.bin") if p.name not in ("training_args.bin", "optimizer.bin")]
    total = 0
    for p in files:
        try:
            total += p.stat().st_size  # follows the HF cache's snapshot -> blob symlinks
        except OSError:
            continue
    if total > 0:
        return total, "sum of *.safetensors/*.bin file sizes"
    num_params = estimate_num_params(config)
    per_param = bytes_per_param(config)
    return int(num_params * per_param), f"estimated from config: {num_params} params x {per_param:g} bytes"


def hub_access_from_env(env: Mapping[str, str]) -> tuple[str | None, bool]:
    """``(hf_home, allow_network)`` as huggingface_hub would see them in ``env``.

    ``HF_HUB_CACHE`` beats ``HF_HOME`` (so pass no hf_home then), and the network
    (fetching only config.json) is allowed unless ``HF_HUB_OFFLINE`` is truthy:
    a fresh container given only ``HF_MODEL_ID`` must still be planned.
    """
    hf_home = None if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") else env.get("HF_HOME")
    offline = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return hf_home, not offline
