"""A blended request's vLLM block hashes are re-salted so vLLM's prefix cache never serves its KV as exact.

Uses vLLM 0.32's own ``Request`` and block hasher (no engine start): the hashes
the scheduler registers a request's blocks under are its ``block_hashes``.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmi_cache.blend.connector import BLEND_SALT_PREFIX, _set_salt  # noqa: E402

BLOCK = 16


def _request(tokens: list[int], salt: str | None = None, req_id: str = "r") -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def test_salting_changes_every_block_hash_and_restoring_gives_them_back() -> None:
    tokens = list(range(100, 100 + 5 * BLOCK + 3))
    request = _request(tokens)
    exact = list(request.block_hashes)
    assert len(exact) == 5
    _set_salt(request, BLEND_SALT_PREFIX + "a")
    salted = list(request.block_hashes)
    assert len(salted) == 5 and not set(salted) & set(exact)
    # Another blended request of the same tokens gets other hashes too (a fresh salt per request).
    other = _request(tokens, req_id="s")
    _set_salt(other, BLEND_SALT_PREFIX + "b")
    assert not set(other.block_hashes) & set(salted)
    _set_salt(request, None)
    assert request.block_hashes == exact


def test_a_tenant_salt_is_restored_exactly() -> None:
    tokens = list(range(7, 7 + 3 * BLOCK))
    request = _request(tokens, salt="tenant-a")
    tenant = list(request.block_hashes)
    _set_salt(request, BLEND_SALT_PREFIX + "x")
    _set_salt(request, "tenant-a")
    assert request.block_hashes == tenant
    assert request.cache_salt == "tenant-a"


def test_hashes_of_tokens_appended_later_chain_from_the_salted_ones() -> None:
    request = _request(list(range(2 * BLOCK)))
    _set_salt(request, BLEND_SALT_PREFIX + "y")
    request.append_output_token_ids(list(range(BLOCK)))
    exact_longer = _request(list(range(3 * BLOCK)), req_id="e")
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] != exact_longer.block_hashes[2]
