"""Typed value parsers for the LMCache-format configuration (YAML values and LMCACHE_* env strings).

Used by ``lmi_cache.config.cache_config`` in every process that reads the engine settings
(vLLM workers and scheduler, autoconfig at container start), so torch-free.
Each parser takes ``(value, where)`` and returns the typed value or raises a
one-line ``ConfigError`` naming ``where`` ("FILE: key 'k'" or "env LMCACHE_K").
Every number is checked for type, finiteness and a sane upper bound before any
arithmetic, so no input can overflow, hang or start an unbounded thread pool.
"""
from __future__ import annotations

import ast
import math
import os
import reprlib
from typing import Any, Mapping

import yaml

from lmi_cache.config.yaml_reader import load_yaml
from lmi_cache.errors import ConfigError
from lmi_cache.plain_files import whole_number
from lmi_cache.remote.url import parse_remote_url

# Upper bounds: far above any real deployment, low enough that sizes stay exact
# floats and byte counts stay 64-bit integers.
MAX_SIZE_GIB = float(1 << 20)  # 1 PiB per rank
MAX_CHUNK_TOKENS = 1 << 16
MAX_TOKENS = 1 << 31
MAX_DISK_WORKERS = 64
MAX_QUEUE_DEPTH = 1 << 16

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def unquote_env(value: str) -> str:
    """An env value as LMCache reads it: surrounding whitespace and one pair of matching quotes removed.

    LMCache evaluates a quoted value as a Python string literal (so ``"'512'"`` is 512 and
    escapes inside the quotes are honoured) and falls back to dropping the quotes.
    """
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            literal = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return text[1:-1]
        return literal if isinstance(literal, str) else text[1:-1]
    return text


def parse_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{where}: expected true or false, got {_show(value)}")


def parse_int(value: Any, where: str, minimum: int = 0, maximum: int = MAX_TOKENS) -> int:
    """An integer in [minimum, maximum]; integral floats (256.0) are accepted, bools are not."""
    parsed = whole_number(value)
    if isinstance(value, str) and len(value) <= 40:
        try:
            parsed = int(value.strip())
        except ValueError:
            parsed = None
    if parsed is None or not minimum <= parsed <= maximum:
        raise ConfigError(f"{where}: expected an integer from {minimum} to {maximum}, got {_show(value)}")
    return parsed


def parse_size_gib(value: Any, where: str) -> float:
    parsed: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        parsed = float(value) if abs(value) < 1e300 else math.inf
    elif isinstance(value, str) and len(value) <= 40:
        try:
            parsed = float(value.strip())
        except ValueError:
            parsed = None
    if parsed is None or not math.isfinite(parsed) or not 0 <= parsed <= MAX_SIZE_GIB:
        raise ConfigError(f"{where}: expected a size in GiB from 0 to {MAX_SIZE_GIB:.0f} (e.g. 5 or 0.5), "
                          f"got {_show(value)}")
    return parsed


def parse_optional_str(value: Any, where: str) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    if isinstance(value, str):
        return value.strip()
    raise ConfigError(f"{where}: expected a string, got {_show(value)}")


def parse_local_disk(value: Any, where: str) -> tuple[str, ...]:
    """``"file:///a/,file:///b/"``, a plain path, or a YAML list -> absolute directories.

    A comma always separates two paths (LMCache's format), so a directory name
    cannot contain one; a NUL byte or a control character is refused too.
    """
    if value is None:
        return ()
    items: list[Any] = list(value) if isinstance(value, (list, tuple)) else [value]
    paths: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{where}: expected file:// paths separated by commas, got {_show(value)}")
        for part in item.split(","):
            part = part.strip()
            if not part or part.lower() in ("none", "null"):
                continue
            if "://" in part:
                scheme, _, rest = part.partition("://")
                if scheme != "file":
                    raise ConfigError(
                        f"{where}: {_show(part)} is not a local path; use file:///dir/ (remote stores go in remote_url)"
                    )
                # file://tmp/cache/ (two slashes, as in LMI's LMCache page, "fixed for SM customers")
                # means /tmp/cache/; lmi_cache.config.cache_config warns that file:///tmp/cache/ is the spelling.
                part = rest if rest.startswith("/") else "/" + rest
            if any(ord(c) < 32 for c in part):
                raise ConfigError(f"{where}: {_show(part)} contains a control character; use a plain directory path")
            if not os.path.isabs(part):
                raise ConfigError(f"{where}: {_show(part)} must be an absolute path such as file:///mnt/nvme/kv/")
            paths.append(os.path.normpath(part))
    return tuple(dict.fromkeys(paths))  # de-duplicate, keep order


def parse_remote_url_value(value: Any, where: str) -> str | None:
    """Any remote_url scheme LMCache accepts, checked by the one parser every reader shares
    (``lmi_cache.remote.url``); a typo'd scheme is an error. Credentials are never echoed."""
    url = parse_optional_str(value, where)
    if url is None:
        return None
    try:
        parse_remote_url(url)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return url


def parse_mapping(value: Any, where: str) -> dict[str, Any]:
    """A mapping, or (from env) a JSON/YAML object in a string; LMCache's single-quoted form is accepted."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = unquote_env(value)
        try:
            value = load_yaml(text, where) if text.strip() else {}  # bounded: no alias bomb, no duplicate key
        except (yaml.YAMLError, RecursionError, ValueError, OverflowError, TypeError):
            raise ConfigError(f"{where}: expected a JSON object such as {{\"use_odirect\": true}}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping such as {{use_odirect: true}}, got {_show(value)}")
    return {str(k): v for k, v in value.items()}


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict = 2, 4, 4
_SHORT_REPR.maxstring, _SHORT_REPR.maxother, _SHORT_REPR.maxlong = 50, 50, 40


def show(value: Any) -> str:
    """A short repr for messages, bounded in time and length.

    User input can be megabytes long, or a YAML alias bomb whose full repr would never end.
    """
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_show = show
