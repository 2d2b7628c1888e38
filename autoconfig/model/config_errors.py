"""The one error a model's config.json (or a --dtype/--kv-cache-dtype that does not fit it) is refused with."""
from __future__ import annotations

from lmi_cache.errors import UserError


class ModelConfigError(UserError):
    """A model config.json that cannot be read as a decoder LLM, or a bad --dtype/--kv-cache-dtype."""
