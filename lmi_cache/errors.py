"""User-facing error types shared by the engine and autoconfig (any process).

Every error a user can cause (bad config key, bad value, unreadable file) is a
``UserError``: the CLI prints its message as one line and exits 2, never a
traceback. Messages name the file and/or key and say what to do.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input; ``str(err)`` is the one line to print."""

    exit_code: int = 2


class ConfigError(UserError):
    """Bad LMCache-format configuration (YAML file or LMCACHE_* env)."""


# Linux's limits (PATH_MAX, NAME_MAX): a longer path fails every file call with ENAMETOOLONG.
MAX_PATH_CHARS = 4095
MAX_NAME_CHARS = 255


def path_length_problem(path: str) -> str | None:
    """Why ``path`` can never name a file (too long for the system), or None; checked before any file call."""
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_CHARS:
        return f"is longer than the system's limit of {MAX_PATH_CHARS} bytes for a path"
    longest = max((len(p.encode("utf-8", "surrogateescape")) for p in path.split("/")), default=0)
    if longest > MAX_NAME_CHARS:
        return f"has a name longer than the system's limit of {MAX_NAME_CHARS} bytes for one file or directory"
    return None
