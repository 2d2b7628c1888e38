"""Start-up check of the remote tier's store for ``configure``/``serve`` (container-start process).

One PING (Redis/Valkey) or HEAD bucket (S3) with a short timeout: a store that
does not answer is a warning, never a failed start (the remote tier then
serves misses until it answers). The peer tier's holder store of its own
(``peer_holders_url``) is checked the same way. Messages never show credentials.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from lmi_cache.remote.settings import RemoteSettings

PROBE_TIMEOUT_S = 1.0


def remote_store_messages(lmcache_config: Mapping[str, Any] | None, config_file: Path | None,
                          env: Mapping[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """``note:``/``warning:`` lines about the remote store of the planned dict or the user's YAML (+ env)."""
    from lmi_cache.config.cache_config import config_from_dict, load_config
    from lmi_cache.config.peer import holder_settings
    from lmi_cache.config.remote import remote_settings
    from lmi_cache.errors import ConfigError

    try:
        if lmcache_config is not None:
            config, _ = config_from_dict(lmcache_config, "planned LMCache config")
        elif config_file is not None:
            config, _ = load_config(str(config_file), env)
        else:
            return []
        stores = [("remote tier", remote_settings(config), "remote lookups are misses and stores are dropped")]
        holders = holder_settings(config, "config") if config.enable_p2p else None
        if holders is not None and holders[1]:  # a store of its own (else it is the remote tier's, probed above)
            stores.append(("peer holder store", holders[0], "peers are found by routers' hints only"))
    except ConfigError as err:
        return [f"warning: remote tier: {err}"]
    return [line for name, settings, meanwhile in stores if settings is not None
            for line in _probe(name, settings, meanwhile, timeout_s)]


def _probe(name: str, settings: "RemoteSettings", meanwhile: str, timeout_s: float) -> list[str]:
    from lmi_cache.remote import probe_remote

    reason = probe_remote(settings, timeout_s)
    if reason is None:
        return [f"note: {name}: the {settings.kind} store {settings.display_url} answers"]
    return [f"warning: {name}: {reason}; the server starts anyway ({meanwhile} until the store answers)"]
