"""The one bounded reader of small user files, and the one refuser of non-numbers (any process; torch-free).

Every file a user hands us (an LMCache YAML, serving.properties, a model's
config.json, a host snapshot) is read the same way: as bytes, at most a
bounded size (a multi-GiB file named by mistake must not be read whole),
decoded strictly, and every failure is one short reason the caller puts after
the file's name with its own advice. JSON that carries ``NaN``/``Infinity``
(Python's json accepts them, no other parser does) is refused by one function.
"""
from __future__ import annotations

import math
from typing import Any, NoReturn


class PlainFileError(ValueError):
    """Why a file could not be read as text: a short clause such as "no such file" (no path, no advice).

    ``kind`` lets a caller give its own advice for the cases that need it:
    "missing", "directory", "unreadable", "too_large" or "encoding".
    """

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.kind = kind


def read_text_file(path: str, limit_bytes: int, encoding: str = "utf-8") -> str:
    """The file's text; PlainFileError naming why not (missing, a directory, unreadable, too large, bad encoding)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(limit_bytes + 1)
    except FileNotFoundError:
        raise PlainFileError("no such file", "missing") from None
    except IsADirectoryError:
        raise PlainFileError("is a directory, not a file", "directory") from None
    except OSError as err:
        raise PlainFileError(f"cannot read ({err.strerror or err})", "unreadable") from None
    if len(raw) > limit_bytes:
        raise PlainFileError(f"larger than {_size(limit_bytes)}", "too_large")
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as err:
        raise PlainFileError(f"not UTF-8 text (bad byte at offset {err.start})", "encoding") from None


def refuse_json_constant(name: str) -> NoReturn:
    """``parse_constant`` for json: NaN, Infinity and -Infinity are not numbers any of our files may hold."""
    raise ValueError(f"the JSON literal {name} is not a number")


def whole_number(value: Any) -> int | None:
    """``value`` as an int when it is one (4096, or JSON's 4096.0); None for bools, NaN, inf, fractions, others."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _size(num_bytes: int) -> str:
    return f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes >> 10} KiB"
