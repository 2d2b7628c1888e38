"""A tiny random-weight audio-language model (Qwen2-Audio shaped) and test tones (test/benchmark process).

vLLM's vision models need torchvision, whose registry wheels are CUDA builds
that do not load beside the CPU torch; an audio model needs none: Qwen2-Audio
is a Whisper-style encoder with a numpy feature extractor in front of a Qwen2
text model. This module writes one such model, small enough for the CPU test
tier: encoder 2 x 64 wide, text model 4 layers of 256 (head_dim 32), float32,
with the local BPE tokenizer of ``tiny_model`` plus the three audio tokens.

vLLM turns every audio clip into a run of the same ``<|AUDIO|>`` placeholder
token (one per encoder frame after pooling), so two clips of one length give
the same token ids and differ only in the multimodal features: exactly the
case the chunk keys must tell apart. Random weights barely react to noise;
pure tones of different pitch change the greedy tokens (``tone``).

Two facts of this transformers release are handled here: it saves the text
model's weights as ``language_model.model.model.*`` where vLLM reads
``language_model.model.*`` (renamed after ``save_pretrained``), and the
processor's chat template is the plain one of ``tiny_model`` (vLLM puts the
audio placeholder text into the message content itself).
"""
from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Any

import numpy as np

from lmi_cache.devtools.tiny_model import CHAT_TEMPLATE, _train_tokenizer, seeded_init

_RECIPE_VERSION = 1
AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
SAMPLE_RATE_HZ = 16000  # Whisper's feature extractor rate
_VOCAB_SIZE = 4096


def tone(frequency_hz: float, seconds: float, sample_rate_hz: int = SAMPLE_RATE_HZ) -> np.ndarray:
    """A pure sine tone (float32, amplitude 0.5)."""
    times_s = np.arange(int(seconds * sample_rate_hz), dtype=np.float64) / sample_rate_hz
    return (0.5 * np.sin(2 * np.pi * frequency_hz * times_s)).astype(np.float32)


def wav_bytes(samples: np.ndarray, sample_rate_hz: int = SAMPLE_RATE_HZ) -> bytes:
    """``samples`` (float in [-1, 1]) as a 16-bit mono WAV file, the form OpenAI's ``input_audio`` carries."""
    import io
    import wave

    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate_hz)
        out.writeframes(pcm)
    return buffer.getvalue()


def make_tiny_audio_model(out_dir: Path, seed: int = 0) -> Path:
    """Create (or reuse) the model folder ``out_dir``; safe from concurrent processes (lock + stamp file)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / ".tiny_audio_model.json"
    want = {"recipe": _RECIPE_VERSION, "seed": seed}
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and json.loads(stamp.read_text()) == want:
            return out_dir
        tokenizer = _train_tokenizer(out_dir, _VOCAB_SIZE, AUDIO_TOKENS)
        _write_processor(out_dir, tokenizer)
        _write_model(out_dir, seed, tokenizer.convert_tokens_to_ids(AUDIO_TOKENS[0]), len(tokenizer))
        stamp.write_text(json.dumps(want))
    return out_dir


def _write_processor(out_dir: Path, tokenizer: Any) -> None:
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=SAMPLE_RATE_HZ)
    Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer,
                        chat_template=CHAT_TEMPLATE).save_pretrained(str(out_dir))


def _write_model(out_dir: Path, seed: int, audio_token_id: int, vocab_size: int) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration, Qwen2Config

    audio = Qwen2AudioEncoderConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                                    num_mel_bins=128, max_source_positions=1500, initializer_range=0.12)
    text = Qwen2Config(vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                       initializer_range=0.12, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                       tie_word_embeddings=False)
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=audio_token_id)
    config.dtype = "float32"
    with seeded_init(seed):
        model = Qwen2AudioForConditionalGeneration(config).float().eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for weights in out_dir.glob("*.safetensors"):
        tensors = load_file(str(weights))
        renamed = {name.replace("language_model.model.model.", "language_model.model."): tensor
                   for name, tensor in tensors.items()}
        save_file(renamed, str(weights), metadata={"format": "pt"})


if __name__ == "__main__":
    import sys

    print(make_tiny_audio_model(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/lmi-cache-tiny-audio")))
