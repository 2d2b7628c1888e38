"""Key partitioning: which requests may share cached KV, case by case (no vLLM; fake requests shaped like vLLM's).

Each case warms the scheduler with request A (its full chunks stored) and asks
how many tokens request B would load: a hit where B's KV for those tokens is
A's, a miss from the first token where they differ. The cases are the ones
collected for KV connectors (multimodal items, prompt embeddings, adapters,
salt, weights). Before the key rule of ``lmi_cache.keys.key_inputs``, the
multimodal, mixed-embeddings and adapter-replaced cases were full hits.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from lmi_cache.blend.scheduler_plan import BlendScheduler
from lmi_cache.blend.settings import BlendSettings
from lmi_cache.keys.hashing import KeySpace
from lmi_cache.keys.key_inputs import KeyRule
from lmi_cache.keys.model_identity import model_identity
from lmi_cache.vllm_connector.metadata import LmiConnectorMetadata, LmiWorkerMeta
from lmi_cache.vllm_connector.scheduler_side import SchedulerGeometry, SchedulerSide
from placement_helpers import directory, stored

CHUNK = 16  # = the block size here: every chunk boundary is a possible hit length
TAG = "cpu.s0123.float32"
P = 99  # the placeholder token vLLM repeats for every image/audio item
TEXT = list(range(1, 33))  # chunks 0-1
TAIL = list(range(200, 220))  # chunk 4 and 4 tokens after it (a partial chunk, so a full hit is 80 tokens)
IMAGE = [P] * 32  # chunks 2-3


def mm(identifier: str, offset: int, length: int, modality: str = "image") -> Any:
    """One ``MultiModalFeatureSpec`` as vLLM's scheduler sees it (data dropped: it may be None there too)."""
    return SimpleNamespace(identifier=identifier, mm_hash=identifier, modality=modality, data=None,
                           mm_position=SimpleNamespace(offset=offset, length=length))


def req(tokens: Sequence[int] | None, features: Sequence[Any] = (), lora: Any = None, salt: str | None = None,
        embeds: np.ndarray | None = None, is_token_ids: Sequence[bool] | None = None) -> Any:
    """A vLLM ``Request``'s key-relevant attributes (``prompt_token_ids`` None: a prompt given as embeddings)."""
    num = len(tokens) if tokens is not None else len(embeds)  # type: ignore[arg-type]
    return SimpleNamespace(request_id="", prompt_token_ids=None if tokens is None else list(tokens),
                           num_prompt_tokens=num, num_tokens=num, mm_features=list(features), lora_request=lora,
                           cache_salt=salt, prompt_embeds=embeds,
                           prompt_is_token_ids=None if is_token_ids is None else np.array(is_token_ids))


def lora(name: str, path: Path | str) -> Any:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))


def scheduler(rule: KeyRule | None = None, identity: str = "") -> SchedulerSide:
    space = lambda tag: KeySpace("m", "float32", tag, CHUNK, model_identity=identity)  # noqa: E731
    side = SchedulerSide(SchedulerGeometry(CHUNK, CHUNK, 1, 0), space, directory(CHUNK), key_rule=rule)
    side.update_from_workers(LmiWorkerMeta(layout_tags={0: TAG}))
    return side


def warm(side: SchedulerSide, request: Any) -> int:
    """Run ``request`` cold and store every full chunk it saves; returns the chunks saved."""
    request.request_id = "warm"
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, 0)
    blocks = list(range(1, 2 + request.num_tokens // CHUNK))
    step = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="warm", block_ids=(blocks,), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens={"warm": request.num_tokens}, finished_req_ids=set(), preempted_req_ids=None)
    meta: LmiConnectorMetadata = side.build_connector_meta(step)
    side.update_from_workers(stored({0: [t.keys[0].digest for t in meta.saves]}, layout_tags={0: TAG}))
    side.request_finished("warm")
    return len(meta.saves)


def hit_after(a: Any, b: Any, side: SchedulerSide | None = None) -> int:
    """Tokens request ``b`` loads from the cache after ``a`` ran."""
    side = side or scheduler()
    warm(side, a)
    b.request_id = "b"
    hit, _ = side.get_num_new_matched_tokens(b, 0)
    assert hit is not None
    return hit


FULL = 80  # five full chunks of the 84-token prompts (at least one token is always computed)


# -- multimodal items -----------------------------------------------------------------------------

def test_same_text_different_image_misses_from_the_image_on() -> None:
    a = req(TEXT + IMAGE + TAIL, [mm("image-a", 32, 32)])
    b = req(TEXT + IMAGE + TAIL, [mm("image-b", 32, 32)])
    assert hit_after(a, b) == 32  # the text before the image still hits; main: 80 (image A's KV for image B)


def test_same_image_repeated_is_a_full_hit() -> None:
    a = req(TEXT + IMAGE + TAIL, [mm("image-a", 32, 32)])
    assert hit_after(a, req(TEXT + IMAGE + TAIL, [mm("image-a", 32, 32)])) == FULL


def test_same_image_different_text_after_it_misses_after_the_divergence() -> None:
    a = req(TEXT + IMAGE + TAIL, [mm("image-a", 32, 32)])
    b = req(TEXT + IMAGE + [t + 1000 for t in TAIL], [mm("image-a", 32, 32)])
    assert hit_after(a, b) == 64


def test_same_image_at_another_position_misses_from_where_they_differ() -> None:
    a = req(TEXT + IMAGE + TAIL, [mm("image-a", 32, 32)])
    b = req(TEXT[:16] + IMAGE + TEXT[16:] + TAIL, [mm("image-a", 16, 32)])
    assert hit_after(a, b) == 16


def test_same_placeholders_split_into_other_items_miss() -> None:
    """The same placeholder tokens, one image of 32 vs two of 16: what the tokens hold differs."""
    a = req(TEXT + IMAGE + TAIL, [mm("image-a", 32, 32)])
    b = req(TEXT + IMAGE + TAIL, [mm("image-a", 32, 16), mm("image-b", 48, 16)])
    assert hit_after(a, b) == 32


def test_two_images_swapped_miss_from_the_first_image_on() -> None:
    a = req(TEXT + IMAGE + TAIL, [mm("image-a", 32, 16), mm("image-b", 48, 16)])
    b = req(TEXT + IMAGE + TAIL, [mm("image-b", 32, 16), mm("image-a", 48, 16)])
    assert hit_after(a, b) == 32  # main: 80


def test_an_item_inside_a_chunk_keys_that_chunk_and_every_later_one() -> None:
    """An image starting mid-chunk: the chunk holding its first placeholder already misses."""
    tokens = TEXT[:24] + [P] * 8 + TEXT[24:] + TAIL[:12]
    a, b = (req(tokens, [mm(name, 24, 8, "audio")]) for name in ("sound-a", "sound-b"))
    assert hit_after(a, b) == 16


def test_items_are_not_cached_when_vllm_names_them_per_request() -> None:
    """With vLLM's prefix cache and processor cache off, identifiers are a per-process counter: no keys at all."""
    side = scheduler(KeyRule(mm_ids_are_content=False))
    a = req(TEXT + IMAGE + TAIL, [mm("renderer0-mm-1-image-0", 32, 32)])
    assert warm(side, a) == 0
    assert hit_after(req(TEXT + TAIL), req(TEXT + TAIL), side) == 48  # text-only requests are still cached


def test_blending_refuses_requests_with_items_or_embeddings() -> None:
    """A segment's KV is computed from token ids alone: such requests take the exact prefix path only."""
    sep = (9, 9)
    blend = BlendScheduler(BlendSettings(enabled=True, min_tokens=4), sep, lambda tag: KeySpace("m", "f", tag, 4),
                           directory(4))
    prompt = [1] * 10 + list(sep) + [P] * 10 + list(sep) + [5, 6, 7]
    for request in (req(prompt, [mm("image-a", 12, 10)]), req(prompt, embeds=np.ones((len(prompt), 4), np.float32))):
        request.request_id = "r"
        assert blend.plan(request, 0, 0, TAG) is None and blend.state("r") is None
    plain = req(prompt)
    plain.request_id = "t"
    blend.plan(plain, 0, 0, TAG)
    assert blend.state("t") is not None  # the same tokens as text are blendable


# -- prompt embeddings ----------------------------------------------------------------------------

def _embeds(seed: int, rows: int = 84, width: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def test_prompt_embeds_never_meet_token_ids() -> None:
    assert hit_after(req([0] * 84), req(None, embeds=_embeds(1))) == 0  # the zeros vLLM stands in for ids


def test_prompt_embeds_are_keyed_by_their_content() -> None:
    assert hit_after(req(None, embeds=_embeds(1)), req(None, embeds=_embeds(2))) == 0
    assert hit_after(req(None, embeds=_embeds(1)), req(None, embeds=_embeds(1))) == FULL
    changed = _embeds(1)
    changed[40] += 1.0  # chunk 2
    assert hit_after(req(None, embeds=_embeds(1)), req(None, embeds=changed)) == 32


def test_mixed_prompts_with_other_embeddings_miss() -> None:
    """Chat prompts mixing ids and embeddings: the embedded positions hold one sentinel id in both."""
    mask = [True] * 32 + [False] * 52
    tokens = TEXT + [7] * 52
    a = req(tokens, embeds=_embeds(1), is_token_ids=mask)
    b = req(tokens, embeds=_embeds(2), is_token_ids=mask)
    assert hit_after(a, b) == 0  # main: 80


# -- adapters, salt, weights ----------------------------------------------------------------------

def _adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_adapters_a_b_and_none_never_share(tmp_path: Path) -> None:
    a, b = _adapter(tmp_path / "a", b"A" * 64), _adapter(tmp_path / "b", b"B" * 64)
    prompt = TEXT + TAIL
    assert hit_after(req(prompt, lora=lora("a", a)), req(prompt, lora=lora("b", b))) == 0
    assert hit_after(req(prompt, lora=lora("a", a)), req(prompt)) == 0
    assert hit_after(req(prompt), req(prompt, lora=lora("a", a))) == 0
    assert hit_after(req(prompt, lora=lora("a", a)), req(prompt, lora=lora("a", a))) == 48


def test_adapter_replaced_in_place_misses_and_an_unchanged_copy_hits(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "a", b"old weights " * 8)
    side, prompt = scheduler(), TEXT + TAIL

    def ask(adapter_id: int) -> int:
        request = req(prompt, lora=SimpleNamespace(lora_name="a", lora_int_id=adapter_id, lora_path=str(folder)))
        request.request_id = f"ask-{adapter_id}"
        hit, _ = side.get_num_new_matched_tokens(request, 0)
        side.request_finished(request.request_id)
        assert hit is not None
        return hit

    warm(side, req(prompt, lora=lora("a", folder)))  # loaded as adapter id 1
    assert ask(1) == 48
    _adapter(folder, b"new weights " * 8)  # same name, same path, same size
    os.utime(folder / "adapter_model.safetensors", ns=(1, 1))  # even with a clock too coarse to move mtime
    # vLLM may still compute with the old weights under id 1: neither a hit nor a save until it reloads.
    assert ask(1) == 0  # main: 48 (the old adapter's KV)
    assert warm(side, req(prompt, lora=lora("a", folder))) == 0
    reloaded = SimpleNamespace(lora_name="a", lora_int_id=2, lora_path=str(folder))
    assert hit_after(req(prompt, lora=reloaded), req(prompt, lora=reloaded), side) == 48  # the new files' own KV
    _adapter(folder, b"old weights " * 8)  # the old files copied back (a new mtime), loaded again as id 3
    assert ask(3) == 48  # the same content: the first KV is right again


def test_salt_partitions() -> None:
    prompt = TEXT + TAIL
    assert hit_after(req(prompt, salt="tenant-1"), req(prompt, salt="tenant-2")) == 0
    assert hit_after(req(prompt, salt="tenant-1"), req(prompt)) == 0
    assert hit_after(req(prompt, salt="tenant-1"), req(prompt, salt="tenant-1")) == 48


def test_model_replaced_in_place_misses(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"\1" * 4096)
    before = model_identity(str(model), env={})
    (model / "model.safetensors").write_bytes(b"\2" * 4096)
    after = model_identity(str(model), env={})
    prompt = req(TEXT + TAIL)
    old, new = scheduler(identity=before), scheduler(identity=after)
    warm(old, prompt)
    keys_old = {k[0].digest for k in old._chunk_keys(prompt)[0]}
    keys_new = {k[0].digest for k in new._chunk_keys(prompt)[0]}
    assert len(keys_old) == 3 and not keys_old & keys_new
    assert {k[0].digest for k in scheduler(identity=before)._chunk_keys(prompt)[0]} == keys_old


def test_text_keys_carry_no_extra_bytes() -> None:
    """A text request's keys are the plain token chain: requests before the key rule (text) keep their keys."""
    space = KeySpace("m", "float32", TAG, CHUNK)
    text = req(TEXT + TAIL)
    assert space.for_inputs(KeyRule().inputs(text)) == space.for_request(TEXT + TAIL)
