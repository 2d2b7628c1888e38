"""LMI's LMCache recipe: ``option.kv_transfer_config`` naming LMCache's connector.

LMI's user guide (serving/docs/lmi/user_guides/lmcache_user_guide.md in
deepjavalibrary/djl-serving) turns LMCache on with
``option.kv_transfer_config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}``
plus the YAML in ``option.lmcache_config_file`` or ``LMCACHE_CONFIG_FILE``.
Read at container start by ``autoconfig.lmi.properties``: such a file runs
lmi-cache's own connector with that YAML (validated against the host like
any ``lmcache_config_file``), or an auto-configured one when no YAML is given.
Upstream LMCache runs only with ``option.lmcache_engine=lmcache``. Pure.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from autoconfig.lmi.properties import RawOption

# Connector names LMCache registers in vLLM (LMCacheConnector was the V0 name).
LMCACHE_CONNECTORS = frozenset({"LMCacheConnectorV1", "LMCacheConnector", "LMCacheConnectorV1Dynamic"})
CONFIG_ENV = "LMCACHE_CONFIG_FILE"


class RecipeError(UserError):
    """An ``option.kv_transfer_config`` that cannot be read."""


@dataclass(frozen=True)
class LmcacheRecipe:
    connector: str  # as the user wrote it, e.g. "LMCacheConnectorV1"
    where: str  # how messages name the kv_transfer_config setting
    user_config: dict[str, Any]  # the user's JSON (kept for upstream LMCache)
    env_config_file: Path | None  # LMCACHE_CONFIG_FILE, when set

    def describe(self, engine: str, auto: bool, config_file: Path | None) -> str:
        """The one line serve prints about what runs instead of the named connector."""
        if engine == "lmcache":
            return f"{self.where}: {self.connector} runs upstream LMCache (option.lmcache_engine=lmcache)"
        what = "an auto-configured tier plan (no LMCache YAML given)" if auto else f"{config_file} (checked against this host)"
        return (f"{self.where}: LMI's LMCache recipe; {self.connector} is served by lmi-cache's connector with "
                f"{what}; set option.lmcache_engine=lmcache to run upstream LMCache instead")

    def upstream_json(self) -> str:
        """The user's kv_transfer_config for upstream LMCache (kv_role defaults to kv_both, as LMI's tests expect)."""
        config = dict(self.user_config)
        config.setdefault("kv_role", "kv_both")
        return json.dumps(config, separators=(",", ":"))


def find_recipe(options: Mapping[str, "RawOption"], env: Mapping[str, str],
                model_dir: Path | None) -> LmcacheRecipe | None:
    """The recipe when ``kv_transfer_config`` names an LMCache connector, else None (other connectors pass through)."""
    opt = options.get("kv_transfer_config")
    if opt is None:
        return None
    try:
        config = json.loads(opt.value)
    except json.JSONDecodeError as err:
        raise RecipeError(f"{opt.where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except (ValueError, RecursionError):  # a number too long to convert, or nesting too deep to parse
        raise RecipeError(f"{opt.where}: not usable JSON (nested too deeply or a number too long)") from None
    if not isinstance(config, dict) or config.get("kv_connector") not in LMCACHE_CONNECTORS:
        return None
    raw = env.get(CONFIG_ENV, "").strip()
    env_file = None
    if raw:
        env_file = Path(raw)
        if not env_file.is_absolute():
            if model_dir is None:
                raise RecipeError(f"environment variable {CONFIG_ENV}={raw!r}: relative, but no model directory "
                                  "is known; use an absolute path")
            env_file = model_dir / env_file
    return LmcacheRecipe(str(config["kv_connector"]), opt.where, config, env_file)
