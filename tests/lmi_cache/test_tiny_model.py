"""The tiny sliding-window model makers: their geometry, and outputs that depend on the prompt (test process).

vLLM-free: the configs are checked as vLLM reads them (``sliding_window``,
``layer_types``) and the Gemma-2 shape is run through transformers.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from lmi_cache.devtools.tiny_model import SPECS, _hf_config, make_tiny_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_mistral_shape_windows_every_layer() -> None:
    config = _hf_config(SPECS["mistral-7m"])
    assert config.model_type == "mistral"
    assert config.sliding_window == 320
    # vLLM applies the model-wide window to every layer only when no layer_types name full layers.
    assert not getattr(config, "layer_types", None) or set(config.layer_types) == {"sliding_attention"}


def test_gemma2_shape_alternates_windowed_and_full_layers() -> None:
    config = _hf_config(SPECS["gemma2-7m"])
    assert config.model_type == "gemma2"
    assert config.sliding_window == 256
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config.tie_word_embeddings  # vLLM's Gemma 2 has no separate lm_head


def test_unknown_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model size"):
        make_tiny_model(tmp_path, "no-such-size")


def _greedy(model: object, tokens: list[int], steps: int = 4) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=steps, do_sample=False)  # type: ignore[attr-defined]
    return out[0, len(tokens):].tolist()


def test_gemma2_shape_output_depends_on_more_than_the_last_token(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "gemma2", "gemma2-7m")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    rng = random.Random(7)
    differing = 0
    for _ in range(4):
        prompt = [rng.randrange(10, 4000) for _ in range(200)]
        # Same last token, different window before it: a model that echoes the last token answers alike.
        other = [rng.randrange(10, 4000) for _ in range(199)] + prompt[-1:]
        differing += _greedy(model, prompt) != _greedy(model, other)
    assert differing >= 3


def test_granite_hybrid_shape_alternates_mamba2_and_attention() -> None:
    from autoconfig.model.kv import kv_layout_from_config

    config = _hf_config(SPECS["granite-hybrid-5m"])
    assert config.model_type == "granitemoehybrid"
    assert config.layer_types == ["linear_attention", "full_attention"] * 2
    info = kv_layout_from_config(config.to_dict(), dtype="float32")  # the e2e tests serve it in float32
    assert info.state is not None and info.state.kind == "mamba2"
    # vLLM 0.32 CPU logged for this model: "Padding mamba page size by 66.78%" to the 128-token attention page
    # of 2 KV heads x 32 x 4 B x 2 (65,536 B): its state page is conv (3, 544) + ssm (8, 64, 16) in float32.
    assert info.state.layer_state_bytes() == (3 * 544 + 8 * 64 * 16) * 4 == 39_296
    assert round(100 * (65_536 - 39_296) / 39_296, 2) == 66.78
