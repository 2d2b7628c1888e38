"""A router's hint names the peer; anything malformed is no hint (never an error), and sources round-trip."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lmi_cache.peer.hint import PeerAddress, peer_hint, peer_source, source_peer, source_tier


def request(params: Any) -> Any:
    return SimpleNamespace(kv_transfer_params=params)


def test_the_hint_names_host_and_rank_0_init_port() -> None:
    hint = {"remote_kv_source": {"remote_host": "10.0.0.5", "remote_port": 8200}}
    assert peer_hint(request(hint)) == PeerAddress("10.0.0.5", 8200)
    assert peer_hint(request({"remote_kv_source": {"remote_host": "h", "remote_port": "8200"}})) == PeerAddress("h", 8200)


@pytest.mark.parametrize("params", [
    None, "x", {}, {"remote_kv_source": None}, {"remote_kv_source": {"remote_host": "h"}},
    {"remote_kv_source": {"remote_host": "", "remote_port": 8200}},
    {"remote_kv_source": {"remote_host": "h", "remote_port": 0}},
    {"remote_kv_source": {"remote_host": "h", "remote_port": 70000}},
    {"remote_kv_source": {"remote_host": 5, "remote_port": 8200}},
    {"remote_kv_source": {"remote_host": "h", "remote_port": "80a"}},
])
def test_a_malformed_hint_is_no_hint(params: Any) -> None:
    assert peer_hint(request(params)) is None
    assert peer_hint(SimpleNamespace()) is None  # a request without kv_transfer_params at all


def test_sources_name_the_tier_and_the_peer() -> None:
    source = peer_source(PeerAddress("10.0.0.5", 8200))
    assert source == "peer@10.0.0.5:8200" and source_tier(source) == "peer"
    assert source_peer(source) == PeerAddress("10.0.0.5", 8200)
    assert source_tier("cpu") == "cpu" and source_peer("cpu") is None and source_peer("peer@nohost") is None
