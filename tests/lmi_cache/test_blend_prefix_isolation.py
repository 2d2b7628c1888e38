"""A blended request's vLLM block hashes past its exact prefix are replaced, so vLLM's prefix cache never serves
its KV as exact; its cache_salt is left alone and its exact blocks keep their hashes.

Uses vLLM 0.32's own ``Request`` and block hasher (no engine start): the hashes
the scheduler registers a request's blocks under are its ``block_hashes``.
"""
from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm

BLOCK = 16


def _request(tokens: list[int], salt: str | None = None, req_id: str = "r") -> Any:
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def test_blocks_past_the_exact_prefix_get_fresh_hashes_and_restoring_gives_them_back() -> None:
    from lmi_cache.vllm_connector.blending import isolate_blocks, restore_blocks

    tokens = list(range(100, 100 + 5 * BLOCK + 3))
    request = _request(tokens, salt="tenant-a")
    exact = list(request.block_hashes)
    assert len(exact) == 5
    isolate_blocks(request, 2)
    isolated = list(request.block_hashes)
    assert isolated[:2] == exact[:2]  # the exact prefix keeps its hashes
    assert len(isolated) == 5 and not set(isolated[2:]) & set(exact)
    assert request.cache_salt == "tenant-a"  # the tenant's salt is not touched
    # Another blended request of the same tokens gets other hashes too (a fresh nonce per request).
    other = _request(tokens, salt="tenant-a", req_id="s")
    isolate_blocks(other, 2)
    assert not set(other.block_hashes[2:]) & set(isolated[2:])
    restore_blocks(request, 2)
    assert request.block_hashes == exact


def test_hashes_of_tokens_appended_later_chain_from_the_fresh_ones() -> None:
    from lmi_cache.vllm_connector.blending import isolate_blocks

    request = _request(list(range(2 * BLOCK)))
    isolate_blocks(request, 0)
    request.append_output_token_ids(list(range(BLOCK)))
    exact_longer = _request(list(range(3 * BLOCK)), req_id="e")
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] != exact_longer.block_hashes[2]
