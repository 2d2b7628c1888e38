"""Start-up check of the remote tier's store for ``configure``/``serve`` (container-start process).

One PING (Redis/Valkey) or HEAD bucket (S3) with a short timeout: a store that
does not answer is a warning, never a failed start (the remote tier then
serves misses until it answers). Messages never show credentials.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

PROBE_TIMEOUT_S = 1.0


def remote_store_messages(lmcache_config: Mapping[str, Any] | None, config_file: Path | None,
                          env: Mapping[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """``note:``/``warning:`` lines about the remote store of the planned dict or the user's YAML (+ env)."""
    from lmi_cache.config.cache_config import config_from_dict, load_config
    from lmi_cache.config.remote import remote_settings
    from lmi_cache.errors import ConfigError

    try:
        if lmcache_config is not None:
            config, _ = config_from_dict(lmcache_config, "planned LMCache config")
        elif config_file is not None:
            config, _ = load_config(str(config_file), env)
        else:
            return []
        settings = remote_settings(config)
        if settings is None:
            return []
        from lmi_cache.remote import probe_remote

        reason = probe_remote(settings, timeout_s)
    except ConfigError as err:
        return [f"warning: remote tier: {err}"]
    if reason is None:
        return [f"note: remote tier: the {settings.kind} store {settings.display_url} answers"]
    return [f"warning: remote tier: {reason}; the server starts anyway (remote lookups are misses and stores "
            "are dropped until the store answers)"]
