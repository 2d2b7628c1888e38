"""The key rule against vLLM's own prefix-cache block hashes, on vLLM-built ``Request`` objects (test process).

For each pair of requests of the conformance cases, chunk ``i`` of the two
gets the same key exactly when vLLM's block hash of block ``i`` is the same
(chunk = block here): the cache keys cover what vLLM's hash covers, no less
(a wrong hit) and no more (a lost hit). One case differs by design: an
adapter replaced in place, which vLLM names by name and path only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmi_cache.keys.hashing import KeySpace
from lmi_cache.keys.key_inputs import KeyRule

pytestmark = pytest.mark.vllm

BLOCK = 16
P = 99
TEXT = list(range(1, 33))
IMAGE = [P] * 32
TAIL = list(range(200, 220))
SPACE = KeySpace("m", "float32", "cpu.s0123.float32", BLOCK)


def vllm_request(tokens: list[int] | None, features: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
                 lora: Any = None, salt: str | None = None, embeds: torch.Tensor | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    specs = [MultiModalFeatureSpec(data=None, modality="image", identifier=name, mm_hash=name,
                                   mm_position=PlaceholderRange(offset=offset, length=length))
             for name, offset, length in features]
    return Request("r", tokens, SamplingParams(max_tokens=1), None, prompt_embeds=embeds, mm_features=specs,
                   lora_request=lora, cache_salt=salt, block_hasher=get_request_block_hasher(BLOCK, sha256))


def same_pattern(a: Any, b: Any) -> list[bool]:
    """Per block: whether vLLM's hashes agree, after checking that ours agree exactly there."""
    vllm_same = [x == y for x, y in zip(a.block_hashes, b.block_hashes)]
    ours_a, ours_b = (SPACE.for_inputs(KeyRule().inputs(r)).per_chunk for r in (a, b))
    assert len(ours_a) == len(a.block_hashes)
    ours_same = [x[0].digest == y[0].digest for x, y in zip(ours_a, ours_b)]
    assert ours_same == vllm_same
    return vllm_same


def test_multimodal_cases_split_where_vllm_splits() -> None:
    prompt = TEXT + IMAGE + TAIL
    one = [("image-a", 32, 32)]
    assert same_pattern(vllm_request(prompt, one), vllm_request(prompt, [("image-b", 32, 32)])) == [True] * 2 + [False] * 3
    assert same_pattern(vllm_request(prompt, one), vllm_request(prompt, one)) == [True] * 5
    swapped = same_pattern(vllm_request(prompt, [("image-a", 32, 16), ("image-b", 48, 16)]),
                           vllm_request(prompt, [("image-b", 32, 16), ("image-a", 48, 16)]))
    assert swapped == [True] * 2 + [False] * 3
    mid = TEXT[:24] + [P] * 8 + TEXT[24:] + TAIL[:12]
    assert same_pattern(vllm_request(mid, [("a", 24, 8)]), vllm_request(mid, [("b", 24, 8)])) == [True, False, False]


def test_salt_lora_and_embeds_split_where_vllm_splits(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    prompt = TEXT + TAIL
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "adapter_model.safetensors").write_bytes(folder.encode() * 64)
    a, b = (LoRARequest(name, 1, str(tmp_path / name)) for name in ("a", "b"))
    assert same_pattern(vllm_request(prompt, salt="s1"), vllm_request(prompt, salt="s2")) == [False] * 3
    assert same_pattern(vllm_request(prompt, lora=a), vllm_request(prompt, lora=b)) == [False] * 3
    assert same_pattern(vllm_request(prompt, lora=a), vllm_request(prompt)) == [False] * 3
    assert same_pattern(vllm_request(prompt, lora=a), vllm_request(prompt, lora=a)) == [True] * 3
    torch.manual_seed(0)
    embeds = torch.randn(52, 8)
    changed = embeds.clone()
    changed[40] += 1
    assert same_pattern(vllm_request(None, embeds=embeds), vllm_request(None, embeds=changed)) == [True, True, False]
    assert same_pattern(vllm_request(None, embeds=embeds.bfloat16()),
                        vllm_request(None, embeds=embeds.bfloat16())) == [True] * 3
