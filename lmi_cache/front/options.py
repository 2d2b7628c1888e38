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
adapter's ``model.py`` formatters (``lmi_cache.front.formatters``). The
front's own limits: ``max_request_bytes`` (default sized from
``max_model_len``), ``max_sessions`` (10,000 open sessions), and
``enable_runtime_adapters`` (default false) with ``runtime_adapter_roots``
and ``max_runtime_adapters`` (``lmi_cache.front.adapter_routes``). The
sessions folder is checked here, before AWS's session library reads it
(``lmi_cache.front.session_store``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from lmi_cache.errors import UserError
from lmi_cache.front.adapter_routes import (
    DEFAULT_MAX_RUNTIME_ADAPTERS,
    MAX_RUNTIME_ENV,
    ROOTS_ENV,
    RUNTIME_ENV,
)
from lmi_cache.front.adapters import (
    ADAPTERS_DIR_ENV,
    HIDDEN_SIZE_ENV,
    MAX_LORA_RANK_ENV,
    VLLM_DEFAULT_MAX_LORA_RANK,
    model_config_int,
    scan_adapters,
)
from lmi_cache.front.formatters import ENABLE_OPTION, FORMATTERS_ENV, FORMATTERS_FILE, scan_formatter_file
from lmi_cache.front.guard import MAX_BODY_ENV, MAX_SESSIONS_ENV
from lmi_cache.front.session_store import DEFAULT_MAX_SESSIONS, SessionsFolderError, prepare_sessions_folder

# The vLLM glue module re-exports the middleware after registering the adapters folder with vLLM.
MIDDLEWARE = "lmi_cache.vllm_connector.front_glue.LmiFrontMiddleware"
FRONT_OPTIONS = frozenset({"enable_stateful_sessions", "sessions_path", "sessions_expiration", ENABLE_OPTION,
                           "max_request_bytes", "max_sessions", "enable_runtime_adapters",
                           "runtime_adapter_roots", "max_runtime_adapters"})
DEFAULT_SESSIONS_PATH = "/dev/shm/djl_sessions"
DEFAULT_SESSIONS_EXPIRATION_S = 1200
# Body limit = the longest prompt in UTF-8 JSON (a token is rarely over 24 bytes, escapes included)
# plus room for parameters and chat structure.
BODY_BYTES_PER_TOKEN = 24
BODY_HEADROOM_BYTES = 1 << 20
BODY_BYTES_WITHOUT_MAX_LEN = 8 << 20


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


def _positive(name: str, raw: str, where: str) -> int:
    if not raw.strip().isdigit() or int(raw) <= 0:
        raise FrontOptionError(f"{where}={raw!r}: expected a positive whole number")
    return int(raw)


def front_launch(options: Mapping[str, str], model_dir: Path | None,
                 origins: Mapping[str, str] | None = None, model_path: Path | None = None,
                 prepare: bool = True) -> FrontLaunch:
    """The flags and environment that turn the front on; raise FrontOptionError on a bad option.

    ``model_dir`` holds serving.properties and the ``adapters/`` folder; ``model_path``
    is the base model's folder when local (its config.json checks adapter shapes and
    sizes the body limit). ``prepare`` cleans the sessions folder (off for a dry run).
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
        cap = _positive("max_sessions", options.get("max_sessions", str(DEFAULT_MAX_SESSIONS)), where("max_sessions"))
        env[MAX_SESSIONS_ENV] = str(cap)
        summary.append(f"stateful sessions: on (expire after {raw} s; at most {cap} open; stored in {path})")
        if prepare:
            try:
                summary += prepare_sessions_folder(Path(path))
            except SessionsFolderError as err:
                raise FrontOptionError(f"{where('sessions_path')}: {err}") from None
    else:
        summary.append("stateful sessions: off")
    summary.append(_body_limit(options, model_path or model_dir, env, where))
    formatters = _bool(ENABLE_OPTION, options.get(ENABLE_OPTION, "false"), where(ENABLE_OPTION))
    summary += _adapters(options, model_dir, env, model_path or model_dir, formatters)
    summary += _runtime_adapters(options, model_dir, env, where)
    return FrontLaunch(["--middleware", MIDDLEWARE], env, summary)


def _body_limit(options: Mapping[str, str], model_path: Path | None, env: dict[str, str],
                where: Callable[[str], str]) -> str:
    if "max_request_bytes" in options:
        limit = _positive("max_request_bytes", options["max_request_bytes"], where("max_request_bytes"))
        how = f"{where('max_request_bytes')}"
    else:
        raw = options.get("max_model_len", "").strip()
        max_len = int(raw) if raw.isdigit() else None
        if max_len is None and model_path is not None:
            max_len = model_config_int(model_path, "max_position_embeddings")
        if max_len:
            limit = max_len * BODY_BYTES_PER_TOKEN + BODY_HEADROOM_BYTES
            how = f"{BODY_BYTES_PER_TOKEN} bytes x max_model_len {max_len} + 1 MiB"
        else:
            limit, how = BODY_BYTES_WITHOUT_MAX_LEN, "max_model_len unknown"
    env[MAX_BODY_ENV] = str(limit)
    return f"request bodies: at most {limit} bytes ({how}; option.max_request_bytes changes it)"


def _runtime_adapters(options: Mapping[str, str], model_dir: Path | None, env: dict[str, str],
                      where: Callable[[str], str]) -> list[str]:
    if not _bool("enable_runtime_adapters", options.get("enable_runtime_adapters", "false"),
                 where("enable_runtime_adapters")):
        return []
    if options.get("enable_lora", "false").strip().lower() != "true":
        raise FrontOptionError(f"{where('enable_runtime_adapters')}=true needs option.enable_lora=true")
    raw_roots = options.get("runtime_adapter_roots", "").strip()
    roots = [Path(r.strip()) for r in raw_roots.split(",") if r.strip()] if raw_roots else \
        ([model_dir / "adapters"] if model_dir is not None else [])
    if not roots or not all(r.is_absolute() for r in roots):
        raise FrontOptionError(f"{where('runtime_adapter_roots')}={raw_roots!r}: give absolute folders, "
                               "comma-separated, that runtime adapters may be loaded from")
    cap = _positive("max_runtime_adapters", options.get("max_runtime_adapters", str(DEFAULT_MAX_RUNTIME_ADAPTERS)),
                    where("max_runtime_adapters"))
    raw_rank = options.get("max_lora_rank", "").strip()
    env.setdefault(MAX_LORA_RANK_ENV, raw_rank if raw_rank.isdigit() else str(VLLM_DEFAULT_MAX_LORA_RANK))
    env.update({RUNTIME_ENV: "true", ROOTS_ENV: os.pathsep.join(str(r) for r in roots), MAX_RUNTIME_ENV: str(cap),
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    return [f"runtime adapters: POST /adapters and /v1/load_lora_adapter on, sources confined to "
            f"{', '.join(str(r) for r in roots)}, at most {cap}"]


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
    hidden = model_config_int(model_path, "hidden_size") if model_path is not None else None
    found = scan_adapters(folder, max_rank, hidden)
    env[ADAPTERS_DIR_ENV] = str(folder)
    env[MAX_LORA_RANK_ENV] = str(max_rank)
    if hidden:
        env[HIDDEN_SIZE_ENV] = str(hidden)
    # vLLM asks LoRA resolvers (ours) for an unknown model name only with this on; it also adds the
    # runtime adapter routes, which the front answers 404 unless option.enable_runtime_adapters=true.
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
