"""Tiny random float32 transformers models (Llama, Qwen2, Qwen3) for the blending tests; no downloads."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 256


def tiny_model(model_type: str = "llama", *, seed: int = 0, **overrides: Any) -> Any:
    """A 4-layer random model in eval mode; ``initializer_range`` large so outputs depend on the prompt."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.12, tie_word_embeddings=False,
    )
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).float().eval()


class DictObject:
    """What ``DictEngine.load`` yields: a stored tensor and the reference the caller releases."""

    def __init__(self, engine: DictEngine, tensor: torch.Tensor) -> None:
        self._engine, self._tensor = engine, tensor
        engine.outstanding += 1

    def payload_tensor(self) -> torch.Tensor:
        return self._tensor

    def release(self) -> None:
        self._engine.outstanding -= 1


class DictEngine:
    """The engine verbs blending uses (``save_many``, ``load``) over a dict; ``metrics`` stands for a rank's
    CacheMetrics where a test needs one; ``outstanding`` counts loaded objects not yet released."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self.objects: dict[bytes, torch.Tensor] = {}
        self.outstanding = 0

    def save_many(self, keys: list[Any], shape: tuple[int, ...], dtype: torch.dtype, fill: Any,
                  tiers: Any) -> list[bool]:
        outs = [torch.empty(shape, dtype=dtype) for _ in keys]
        fill(outs)
        for key, out, names in zip(keys, outs, tiers):
            if names:  # planned nowhere: not stored, as a real engine
                self.objects[key.digest] = out
        return [bool(names) for names in tiers]

    def load(self, keys: list[Any], sources: Any, promote: Any = None) -> Iterator[list[tuple[int, DictObject]]]:
        hits = [(i, DictObject(self, self.objects[key.digest])) for i, key in enumerate(keys)
                if sources[i] and key.digest in self.objects]
        if hits:
            yield hits


def paged_blend_worker(ratio: float, block_tokens: int = 16) -> tuple[Any, Any, list[torch.Tensor]]:
    """(BlendWorker, HFLayerwiseModel, CPU paged KV layers) over a tiny Llama: a worker past register_kv_caches."""
    from lmi_cache.blend.hf_adapter import HFLayerwiseModel
    from lmi_cache.blend.paged_kv import PagedKV
    from lmi_cache.blend.settings import BlendSettings
    from lmi_cache.blend.worker_jobs import BlendWorker
    from lmi_cache.transfer.layouts import ExpectedGeometry, describe_kv_caches

    hf = tiny_model("llama")
    model = HFLayerwiseModel(hf)
    kv_heads, head_dim = hf.config.num_key_value_heads, model.head_dim
    layers = [torch.zeros(32, kv_heads, block_tokens, 2 * head_dim) for _ in range(model.num_layers)]
    geometry = ExpectedGeometry(block_size_tokens=block_tokens, num_kv_heads=kv_heads, head_size=head_dim)
    layout = describe_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)}, geometry)
    settings = BlendSettings(enabled=True, recompute_ratios=(ratio,), min_tokens=0)
    return BlendWorker(settings, model, PagedKV(layers, layout, block_tokens), rank_index=0), model, layers
