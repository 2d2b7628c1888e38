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
