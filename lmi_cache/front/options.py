"""LMI's front-door options -> what ``lmi-cache serve`` passes to vLLM (pure, no vLLM import).

Runs in the container-start process (``lmi-cache serve``), before vLLM is
imported. LMI settings (djl-serving ``serving/docs/stateful_sessions.md``):
``enable_stateful_sessions`` (default true), ``sessions_path`` (default
``/dev/shm/djl_sessions``), ``sessions_expiration`` (seconds, default 1200),
each as ``option.<name>`` or ``OPTION_<NAME>``. They become the
``SAGEMAKER_*`` variables of AWS's session library that vLLM's server uses.
With ``option.enable_lora=true`` the model directory's ``adapters/`` folder is
checked and handed to the front (``lmi_cache.front.adapters``);
``option.enable_adapter_formatters=true`` (default false) also runs each
adapter's ``model.py`` formatters (``lmi_cache.front.formatters``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from lmi_cache.errors import UserError
from lmi_cache.front.adapters import (
    ADAPTERS_DIR_ENV,
    HIDDEN_SIZE_ENV,
    MAX_LORA_RANK_ENV,
    VLLM_DEFAULT_MAX_LORA_RANK,
    model_hidden_size,
    scan_adapters,
)
from lmi_cache.front.formatters import ENABLE_OPTION, FORMATTERS_ENV, FORMATTERS_FILE, scan_formatter_file

MIDDLEWARE = "lmi_cache.front.middleware.LmiFrontMiddleware"
FRONT_OPTIONS = frozenset({"enable_stateful_sessions", "sessions_path", "sessions_expiration", ENABLE_OPTION})
DEFAULT_SESSIONS_PATH = "/dev/shm/djl_sessions"
DEFAULT_SESSIONS_EXPIRATION_S = 1200


class FrontOptionError(UserError):
    """A bad value of a sessions/adapters option (names the option and what to do)."""


@dataclass(frozen=True)
class FrontLaunch:
    argv: list[str]
    env: dict[str, str]
    summary: list[str] = field(default_factory=list)


def _bool(name: str, raw: str, where: str) -> bool:
    low = raw.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    raise FrontOptionError(f"{where}={raw!r}: expected true or false")


def front_launch(options: Mapping[str, str], model_dir: Path | None,
                 origins: Mapping[str, str] | None = None, model_path: Path | None = None) -> FrontLaunch:
    """The flags and environment that turn the front on; raise FrontOptionError on a bad option.

    ``model_dir`` holds serving.properties and the ``adapters/`` folder; ``model_path``
    is the base model's folder when local (its config.json checks adapter shapes).
    """
    origins = origins or {}

    def where(name: str) -> str:
        return origins.get(name) or f"option.{name}"

    env: dict[str, str] = {}
    summary: list[str] = []
    enabled = _bool("enable_stateful_sessions", options.get("enable_stateful_sessions", "true"),
                    where("enable_stateful_sessions"))
    env["SAGEMAKER_ENABLE_STATEFUL_SESSIONS"] = "true" if enabled else "false"
    if enabled:
        raw = options.get("sessions_expiration", str(DEFAULT_SESSIONS_EXPIRATION_S)).strip()
        if not raw.isdigit() or int(raw) <= 0:
            raise FrontOptionError(f"{where('sessions_expiration')}={raw!r}: expected a positive number of seconds")
        path = options.get("sessions_path", DEFAULT_SESSIONS_PATH).strip()
        if not path:
            raise FrontOptionError(f"{where('sessions_path')}: empty; give a directory or remove the setting")
        env["SAGEMAKER_SESSIONS_EXPIRATION"] = raw
        env["SAGEMAKER_SESSIONS_PATH"] = path
        summary.append(f"stateful sessions: on (expire after {raw} s; stored in {path})")
    else:
        summary.append("stateful sessions: off")
    formatters = _bool(ENABLE_OPTION, options.get(ENABLE_OPTION, "false"), where(ENABLE_OPTION))
    summary += _adapters(options, model_dir, env, model_path or model_dir, formatters)
    return FrontLaunch(["--middleware", MIDDLEWARE], env, summary)


def _adapters(options: Mapping[str, str], model_dir: Path | None, env: dict[str, str],
              model_path: Path | None, formatters: bool = False) -> list[str]:
    folder = model_dir / "adapters" if model_dir is not None else None
    has_folder = folder is not None and folder.is_dir()
    lora = options.get("enable_lora", "false").strip().lower() == "true"
    if not lora:
        return [f"adapters: {folder} ignored; set option.enable_lora=true to serve them"] if has_folder else []
    if not has_folder or folder is None:
        return ["adapters: LoRA on, no adapters folder (load adapters at run time or use option.lora_modules)"]
    raw_rank = options.get("max_lora_rank", str(VLLM_DEFAULT_MAX_LORA_RANK)).strip()
    max_rank = int(raw_rank) if raw_rank.isdigit() else VLLM_DEFAULT_MAX_LORA_RANK
    hidden = model_hidden_size(model_path) if model_path is not None else None
    found = scan_adapters(folder, max_rank, hidden)
    env[ADAPTERS_DIR_ENV] = str(folder)
    env[MAX_LORA_RANK_ENV] = str(max_rank)
    if hidden:
        env[HIDDEN_SIZE_ENV] = str(hidden)
    # vLLM asks LoRA resolvers (ours) for an unknown model name only with this on.
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    if formatters:
        env[FORMATTERS_ENV] = "true"
    lines = []
    for adapter in found.values():
        error, extra = adapter.error, ""
        code = adapter.path / FORMATTERS_FILE
        if error is None and code.is_file():
            if not formatters:
                extra = f"; its {FORMATTERS_FILE} is not run: set option.{ENABLE_OPTION}=true to apply its formatters"
            else:
                try:
                    kinds = scan_formatter_file(code)  # read, not run: the API server imports it
                except ValueError as err:
                    error = str(err)
                else:
                    extra = (f"; {', '.join(kinds)} formatter{'s' if len(kinds) > 1 else ''} from {FORMATTERS_FILE}"
                             if kinds else f"; {FORMATTERS_FILE} declares no @input_formatter/@output_formatter")
        if error is None:
            lines.append(f"adapter {adapter.name}: registered (rank {adapter.rank}; loaded on first use{extra})")
        else:
            lines.append(f"adapter {adapter.name}: REFUSED ({error}); requests naming it get 424")
    return lines or [f"adapters: {folder} holds no adapter folders"]
