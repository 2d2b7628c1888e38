"""LMI ``option.*`` settings -> vLLM OpenAI-server command-line arguments.

Run by ``lmi-cache serve`` in the container-start process, before vLLM is
imported: the catalogue of vLLM 0.32 arguments is a static table
(``autoconfig/data/vllm_cli_args.json``, generated from the installed
``EngineArgs`` and server parser; a test keeps it in sync), so a typo in
serving.properties fails in milliseconds instead of after model loading.
Pure: no I/O besides reading that packaged table once.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from autoconfig.lmi.blend_options import BLEND_OPTIONS
from autoconfig.lmi.names import (
    FRONT_OPTION_NAMES,
    LMI_IGNORED,
    LMI_RENAMES,
    LMI_VALUES,
    REMOVED_VLLM_ARGS,
    SECRET_OPTIONS,
)
from lmi_cache.errors import UserError

__all__ = ["LMI_IGNORED", "LMI_RENAMES", "LmiOptionError", "MappedArgs", "map_lmi_options", "vllm_arg_table"]


class LmiOptionError(UserError):
    """An ``option.*`` setting that vLLM would refuse (unknown name or bad value)."""


# Options consumed elsewhere: the model location, and the cache setup that
# autoconfig.lmi.properties reads (keep in step with its module docstring).
MODEL_OPTION = "model_id"
LMCACHE_OPTIONS = frozenset({
    "lmcache_auto_config", "lmcache_config_file", "lmcache_max_local_cpu_size",
    "lmcache_max_local_disk_size", "lmcache_local_disk", "lmcache_chunk_size", "lmcache_use_odirect",
    "lmcache_engine", "lmcache_remote_url", "lmcache_session_retention_share",
    "lmcache_enable_p2p", "lmcache_p2p_host", "lmcache_p2p_init_ports", "lmcache_p2p_lookup_ports",
    "lmcache_peer_holders_url",
}) | frozenset(BLEND_OPTIONS)

# vLLM arguments that serve controls itself: a user value would break the
# SageMaker contract (port 8080, /ping) or the model/cache wiring.
RESERVED: dict[str, str] = {
    "host": "the server always listens on 0.0.0.0",
    "port": "set SAGEMAKER_BIND_TO_PORT instead",
    "uds": "the server listens on TCP for SageMaker",
    "model": "use option.model_id",
    "headless": "the container must serve HTTP",
    "grpc": "the container must serve HTTP",
    "grpc_port": "the container must serve HTTP",
    "config": "put the settings in serving.properties",
}
_SIZE_RE = re.compile(r"^\d+$|^\d+(\.\d+)?[kKmMgGtT]$")
_TRUE = {"true"}  # LMI booleans are true/false only (as autoconfig.lmi.properties)
_FALSE = {"false"}


@dataclass(frozen=True)
class VllmArgSpec:
    name: str  # vLLM's dest, e.g. "tensor_parallel_size"
    flag: str  # e.g. "--tensor-parallel-size"
    kind: str  # bool | store_true | int | size | size_or_auto | float | str | list | json | json_or_str
    group: str  # "engine" (EngineArgs field) or "frontend" (server-only)
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class MappedArgs:
    """vLLM arguments derived from LMI options, plus what was ignored and why."""

    values: dict[str, Any] = field(default_factory=dict)  # vLLM dest -> typed value
    sources: dict[str, str] = field(default_factory=dict)  # vLLM dest -> LMI option name it came from
    notes: list[str] = field(default_factory=list)
    # Secret options (api_key, hf_token): vLLM reads them from its environment, never from argv.
    secrets: dict[str, Any] = field(default_factory=dict)

    def argv(self, skip: frozenset[str] = frozenset()) -> list[str]:
        """Command-line flags in a stable order (sorted by vLLM name)."""
        table = vllm_arg_table()
        out: list[str] = []
        for name in sorted(self.values):
            if name not in skip:
                out += render_flag(table[name], self.values[name])
        return out


@lru_cache(maxsize=1)
def _table_doc() -> dict[str, Any]:
    text = resources.files("autoconfig").joinpath("data/vllm_cli_args.json").read_text(encoding="utf-8")
    doc: dict[str, Any] = json.loads(text)
    return doc


def vllm_table_version() -> str:
    """The vLLM version the packaged table was generated from."""
    return str(_table_doc()["vllm_version"])


@lru_cache(maxsize=1)
def vllm_arg_table() -> dict[str, VllmArgSpec]:
    return {
        name: VllmArgSpec(name, e["flag"], e["kind"], e["group"], tuple(e.get("choices", ())))
        for name, e in _table_doc()["args"].items()
    }


def known_option_names() -> list[str]:
    """Every option name serve accepts (for did-you-mean hints)."""
    return sorted(
        set(vllm_arg_table()) | set(LMI_RENAMES) | set(LMI_IGNORED) | set(REMOVED_VLLM_ARGS) | LMCACHE_OPTIONS
        | FRONT_OPTION_NAMES | {MODEL_OPTION}
    )


def map_lmi_options(
    options: Mapping[str, str], origins: Mapping[str, str] | None = None, num_gpus: int | None = None
) -> MappedArgs:
    """Translate LMI options (names without the ``option.`` prefix) to typed vLLM values.

    ``origins`` maps an option name to where it was set (e.g.
    ``serving.properties``, ``env OPTION_X``) for error messages; ``num_gpus``
    resolves ``tensor_parallel_degree=max`` (None keeps "max"). Raises
    LmiOptionError naming the option on the first unknown name or bad value.
    """
    origins = origins or {}
    table = vllm_arg_table()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    secrets: dict[str, Any] = {}
    for name in sorted(options):
        raw = options[name]
        label = origins.get(name) or f"option.{name}"
        if name == MODEL_OPTION or name in LMCACHE_OPTIONS or name in FRONT_OPTION_NAMES:
            continue  # read by autoconfig.lmi.properties / the front door (lmi_cache.front.options), not vLLM
        if name in LMI_IGNORED:
            notes.append(f"option.{name}={raw} ignored: {LMI_IGNORED[name]}")
            continue
        if name in REMOVED_VLLM_ARGS:
            notes.append(f"option.{name}={raw} ignored: not a vLLM 0.32 argument ({REMOVED_VLLM_ARGS[name]})")
            continue
        if name in RESERVED:
            raise LmiOptionError(f"{label}: cannot be set here ({RESERVED[name]})")
        target = LMI_RENAMES.get(name, name)
        spec = table.get(target)
        if spec is None:
            raise LmiOptionError(f"{label}: unknown option{_did_you_mean(name)}")
        if target == "tensor_parallel_size" and raw.strip().lower() == "max":
            # LMI's "all GPUs": only the container knows the count (autoconfig.lmi.properties resolves it).
            value: Any = num_gpus if num_gpus is not None else "max"
        else:
            value = parse_value(spec, LMI_VALUES.get(target, {}).get(raw.strip().lower(), raw), label)
        if target in SECRET_OPTIONS:
            secrets[target] = value
            continue
        if target in values and values[target] != value:
            other = sources[target]
            raise LmiOptionError(
                f"{label}={raw} conflicts with {origins.get(other) or 'option.' + other}={options[other]} "
                f"(both set vLLM's {target}); keep one"
            )
        values[target] = value
        sources[target] = name
    return MappedArgs(values=values, sources=sources, notes=notes, secrets=secrets)


def parse_value(spec: VllmArgSpec, raw: str, label: str) -> Any:
    """Check ``raw`` against the argument's kind; return a typed value or raise naming ``label``."""
    text = raw.strip()
    if spec.kind in ("bool", "store_true"):
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise LmiOptionError(f"{label}={raw!r}: expected true or false")
    if spec.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise LmiOptionError(f"{label}={raw!r}: expected an integer") from None
    if spec.kind in ("size", "size_or_auto"):
        # vLLM's human-readable integers: 4096, 4k (decimal), 4K (binary); -1/auto where allowed.
        if _SIZE_RE.match(text) or (spec.kind == "size_or_auto" and text.lower() in ("auto", "-1")):
            return text
        raise LmiOptionError(f"{label}={raw!r}: expected an integer such as 4096 or 4k")
    if spec.kind == "float":
        try:
            number = float(text)
        except ValueError:
            raise LmiOptionError(f"{label}={raw!r}: expected a number") from None
        if number != number or number in (float("inf"), float("-inf")):  # NaN or infinite: vLLM would misbehave
            raise LmiOptionError(f"{label}={raw!r}: expected a finite number")
        return number
    if spec.kind == "json" or (spec.kind == "json_or_str" and text[:1] in ("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise LmiOptionError(f"{label}: not valid JSON ({err.msg} at column {err.colno})") from None
        except (ValueError, RecursionError):  # a number too long to convert, or nesting too deep to parse
            raise LmiOptionError(f"{label}: not usable JSON (nested too deeply or a number too long)") from None
    if spec.kind == "list":
        if text.startswith("["):
            try:
                items = json.loads(text)
            except json.JSONDecodeError as err:
                raise LmiOptionError(f"{label}: not a valid JSON list ({err.msg})") from None
            except (ValueError, RecursionError):
                raise LmiOptionError(f"{label}: not a usable JSON list (nested too deeply or a number too long)") from None
            if not isinstance(items, list) or not items:
                raise LmiOptionError(f"{label}: expected a non-empty JSON list")
            for item in items:
                _refuse_flag_like(str(item), label)
            return [str(i) for i in items]
        items = [i for i in text.replace(",", " ").split() if i]
        if not items:
            raise LmiOptionError(f"{label}: expected one or more values")
        for item in items:
            _refuse_flag_like(item, label)
        return items
    if spec.choices and text not in spec.choices:
        raise LmiOptionError(f"{label}={raw!r}: expected one of {', '.join(spec.choices)}")
    if not text:
        raise LmiOptionError(f"{label}: empty value; remove the line or give a value")
    _refuse_flag_like(text, label)
    return text


def _refuse_flag_like(value: str, label: str) -> None:
    """A value vLLM's parser could read as a flag is refused (the value itself is not echoed: it may be a secret)."""
    if value.startswith("-") and not _is_number(value):
        raise LmiOptionError(f"{label}: a value may not start with '-' (vLLM would read it as a flag); "
                             "give one plain value, or several separated by commas for a list")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def render_flag(spec: VllmArgSpec, value: Any) -> list[str]:
    """One argument as vLLM's parser expects it."""
    if spec.kind == "bool":
        return [spec.flag if value else "--no-" + spec.flag[2:]]
    if spec.kind == "store_true":
        return [spec.flag] if value else []
    if spec.kind == "list":
        return [spec.flag, *value]
    if not isinstance(value, str) and spec.kind in ("json", "json_or_str"):
        return [spec.flag, json.dumps(value, separators=(",", ":"))]
    return [spec.flag, str(value)]


def flag_to_name() -> dict[str, str]:
    """``--tensor-parallel-size`` -> ``tensor_parallel_size`` (to read rendered argv back)."""
    return {spec.flag: name for name, spec in vllm_arg_table().items()}


def _did_you_mean(name: str) -> str:
    candidates = sorted(LMCACHE_OPTIONS) if name.startswith("lmcache_") else known_option_names()
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.7)
    if close:
        return f"; did you mean option.{close[0]}?"
    return "; see the vLLM engine arguments (names with underscores) or the LMI options in README"
