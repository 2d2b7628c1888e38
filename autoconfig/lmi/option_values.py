"""Value parsers for LMI options (serving.properties, ``OPTION_*`` and the flags that stand for them).

Pure functions used by ``autoconfig.lmi.properties`` at container start and in the
CLI: each takes the text as written and returns the typed value, or raises
``ValueError`` with what the value must be (the caller adds where it came from).
"""
from __future__ import annotations

from pathlib import Path

from autoconfig.lmi.names import LMI_VALUES


def parse_bool(value: str) -> bool:
    """LMI booleans: true/false in any case; anything else is an error, not silently false."""
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    raise ValueError("must be true or false")


def parse_tp(value: str, gpu_count: int | None, pp: int = 1) -> int:
    if value.lower() == "max":
        return max(1, (gpu_count or 0) // pp)
    try:
        return positive_int(value)
    except ValueError:
        raise ValueError("must be a positive integer or 'max' (all GPUs)") from None


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError("must be a positive integer") from None
    if number < 1:
        raise ValueError("must be a positive integer")
    return number


def fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError("must be a number in (0, 1]") from None
    if not 0 < number <= 1:
        raise ValueError("must be a number in (0, 1]")
    return number


def share(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError("must be a number from 0 to 1") from None
    if not 0 <= number <= 1:
        raise ValueError("must be a number from 0 to 1")
    return number


def gib_size(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError("must be a size in GiB per rank (a number, 0 disables the tier)") from None
    if not number >= 0 or number == float("inf"):
        raise ValueError("must be a size in GiB per rank, 0 or more")
    return number


def one_word(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise ValueError("must be one word, e.g. auto, bfloat16, fp8")
    return value


def lmi_dtype(value: str) -> str:
    """LMI's dtype values (fp16, bf16, fp32) become vLLM's; vLLM's own names pass unchanged."""
    return LMI_VALUES["dtype"].get(value.lower(), one_word(value))


def engine_name(value: str) -> str:
    if value not in ("lmi_cache", "lmcache"):
        raise ValueError("must be lmi_cache (this project's connector) or lmcache (upstream LMCache)")
    return value


def nonempty(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def abs_dir_path(value: str) -> str:
    path = value[len("file://"):] if value.startswith("file://") else value
    if not path.startswith("/"):
        raise ValueError("must be an absolute directory path or a file:///path/ URL")
    return path


def config_path(value: str, model_dir: Path | None) -> Path:
    if not value:
        raise ValueError("must be a path to an LMCache YAML file")
    path = Path(value)
    if not path.is_absolute():
        if model_dir is None:
            raise ValueError("is relative but no model directory is known; use an absolute path")
        path = model_dir / path
    return path
