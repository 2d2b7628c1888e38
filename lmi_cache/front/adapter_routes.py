"""Which adapters a request may name, and the runtime adapter routes, confined (front door, no vLLM).

Runs in vLLM's API server process, used by the front middleware. vLLM asks
LoRA resolvers (the model directory's ``adapters/`` folder) for an unknown
model name only while ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set, and that
same setting adds management routes: vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, and AWS's ``POST /adapters`` (``{"name", "src"}``)
and ``DELETE /adapters/{name}``, which SageMaker inference components use to
register adapters. The front keeps those routes answering 404 unless the
operator turned them on (``option.enable_runtime_adapters=true``); then a
source must resolve, symlinks followed, to a folder inside the configured
roots and pass the same PEFT checks as the folder's adapters before vLLM sees
it, and names are bounded in length and count. A request naming a model that
is neither the base model nor a known adapter is refused before vLLM would
keep a lock for that name.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from lmi_cache.front.adapters import VLLM_DEFAULT_MAX_LORA_RANK, Adapter, check_adapter
from lmi_cache.front.guard import ClientError

RUNTIME_ENV = "LMI_CACHE_RUNTIME_ADAPTERS"  # "true": the management routes are on
ROOTS_ENV = "LMI_CACHE_RUNTIME_ADAPTER_ROOTS"  # os.pathsep-separated folders sources must lie in
MAX_RUNTIME_ENV = "LMI_CACHE_MAX_RUNTIME_ADAPTERS"
DEFAULT_MAX_RUNTIME_ADAPTERS = 64
MAX_NAME_CHARS = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
LOAD_PATHS = frozenset({"/v1/load_lora_adapter"})
UNLOAD_PATHS = frozenset({"/v1/unload_lora_adapter"})
SAGEMAKER_ADAPTERS = "/adapters"


def is_adapter_route(path: str) -> bool:
    return path in LOAD_PATHS or path in UNLOAD_PATHS or path == SAGEMAKER_ADAPTERS \
        or path.startswith(SAGEMAKER_ADAPTERS + "/")


def _shown(name: str) -> str:
    """A client-supplied name safe to echo: bounded, printable."""
    text = name if len(name) <= 64 else name[:61] + "..."
    return repr(text)


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ClientError(400, "adapter name missing; give a name of letters, digits, '.', '_', ':' or '-'")
    if len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name):
        raise ClientError(400, f"adapter name {_shown(name)} refused: at most {MAX_NAME_CHARS} letters, digits, "
                               "'.', '_', ':' or '-', starting with a letter or digit")
    return name


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long for the file system, a folder we may not read: not a source
        return False


@dataclass
class AdapterRoutes:
    """The adapters requests may name, and the guarded runtime routes."""

    static: dict[str, Adapter] = field(default_factory=dict)  # the model directory's folder (refused ones too)
    enabled: bool = False
    roots: list[Path] = field(default_factory=list)
    max_runtime: int = DEFAULT_MAX_RUNTIME_ADAPTERS
    max_rank: int = VLLM_DEFAULT_MAX_LORA_RANK
    hidden_size: int | None = None
    runtime: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def from_env(cls, static: dict[str, Adapter], env: dict[str, str], max_rank: int,
                 hidden_size: int | None) -> AdapterRoutes:
        roots = [Path(p) for p in env.get(ROOTS_ENV, "").split(os.pathsep) if p]
        raw = env.get(MAX_RUNTIME_ENV, "")
        return cls(static, env.get(RUNTIME_ENV) == "true", roots,
                   int(raw) if raw.isdigit() else DEFAULT_MAX_RUNTIME_ADAPTERS, max_rank, hidden_size)

    def known(self, name: str) -> bool:
        return name in self.static or name in self.runtime

    def check_model(self, name: str, base_names: frozenset[str] | None) -> None:
        """Refuse a model name that is neither a base model nor a known adapter (404), or not a name (400)."""
        if not name or self.known(name) or (base_names is not None and name in base_names):
            return
        if base_names is None:  # the base model's name is unknown here: only bound the name
            if len(name) > 1024:
                raise ClientError(400, "model name over 1024 characters")
            return
        raise ClientError(404, f"model {_shown(name)} is not served here: name the base model or an adapter "
                               "from the adapters/ folder")

    def _off(self) -> ClientError:
        return ClientError(404, "runtime adapter loading is off: adapters come from the model directory's "
                                "adapters/ folder (option.enable_runtime_adapters=true turns these routes on)")

    def load_request(self, path: str, data: Any, query: bytes) -> tuple[str, Path, dict[str, Any]]:
        """(name, real folder, the body vLLM gets) for a load/register request; ClientError when refused."""
        if not self.enabled:
            raise self._off()
        if not isinstance(data, dict):
            data = {k: v[0] for k, v in parse_qs(query.decode("latin-1")).items()}  # AWS's route takes either
        name_key, src_key = ("lora_name", "lora_path") if path in LOAD_PATHS else ("name", "src")
        name = check_name(data.get(name_key))
        if name in self.static:
            raise ClientError(409, f"adapter {_shown(name)} comes from the adapters/ folder; pick another name")
        if name not in self.runtime and len(self.runtime) >= self.max_runtime:
            raise ClientError(429, f"{self.max_runtime} runtime adapters are registered, the most this server "
                                   "keeps (option.max_runtime_adapters); unregister one first")
        folder = self.confine(data.get(src_key))
        try:
            check_adapter(folder, self.max_rank, self.hidden_size)
        except ValueError as err:
            raise ClientError(400, f"adapter {_shown(name)} is not a usable PEFT LoRA adapter",
                              f"{folder}: {err}") from None
        # vLLM gets the resolved folder: a symlink swapped after this check cannot redirect it.
        return name, folder, {**data, src_key: str(folder)}

    def confine(self, src: Any) -> Path:
        """The real folder ``src`` names inside one of the roots; ClientError 403 otherwise."""
        if not isinstance(src, str) or not src or len(src) > 4096 or "\0" in src or "://" in src:
            raise ClientError(400, "adapter source must be a local folder path")
        for root in self.roots:
            real_root = Path(os.path.realpath(root))
            candidate = Path(os.path.realpath(root / src))  # an absolute src replaces the root
            if candidate != real_root and candidate.is_relative_to(real_root) and _is_dir(candidate):
                return candidate
        raise ClientError(403, "adapter source is outside the folders adapters may be loaded from",
                          f"source {src!r} not under {[str(r) for r in self.roots]}")

    def unload_name(self, path: str, data: Any) -> str:
        if not self.enabled:
            raise self._off()
        raw: Any = path[len(SAGEMAKER_ADAPTERS) + 1:] if path.startswith(SAGEMAKER_ADAPTERS + "/") else \
            (data.get("lora_name") if isinstance(data, dict) else None)
        name = check_name(raw)
        if name not in self.runtime:
            raise ClientError(404, f"adapter {_shown(name)} was not registered at run time")
        return name
