"""Multimodal requests through ``lmi-cache serve``'s OpenAI chat route: one sound's KV never answers another.

A tiny random Qwen2-Audio-shaped model (``lmi_cache.devtools.tiny_audio_model``):
vLLM turns each clip into the same run of ``<|AUDIO|>`` placeholder tokens, so
two clips of one length give the same token ids. Same system text, clip A
(200 Hz tone) then clip B (5 kHz): B must get B's own answer, equal to vLLM
without a connector (float32: tokens equal, logprobs within 1e-4), while the
system text before the clip is still loaded from the cache; A repeated is
served from the cache, and the loaded tokens are counted on ``/metrics``.

Two vLLM starts in all: the reference (a vLLM job without a connector: the same
conversations through ``LLM.chat``, one at a time) and ``lmi-cache serve`` with the connector.
"""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_support import phase, run_job
from test_serve_e2e import external_hit_tokens, free_port, metric_values, post, running_serve, serve_env

from lmi_cache.devtools.tiny_audio_model import tone, wav_bytes

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 128  # = vLLM's CPU block size: the system text spans whole chunks before the clip
SYSTEM = " ".join(f"note{i} the listener answers about the sound" for i in range(40))
SOUNDS = {"A": tone(200.0, 6.0), "B": tone(5000.0, 6.0)}
LOGPROB_TOLERANCE = 1e-4
MAX_TOKENS = 8
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def chat(sound: str) -> dict[str, Any]:
    clip = base64.b64encode(wav_bytes(SOUNDS[sound])).decode()
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
                                         {"type": "text", "text": "What is this sound?"}]},
        ],
        "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }


def answer(reply: dict[str, Any]) -> dict[str, Any]:
    """What is compared: the generated token ids, their logprobs, and the prompt's cached tokens."""
    content = reply["choices"][0]["logprobs"]["content"]
    details = reply["usage"].get("prompt_tokens_details") or {}
    return {"tokens": [int(c["token"].removeprefix("token_id:")) for c in content],
            "logprobs": [c["logprob"] for c in content],
            "prompt_tokens": reply["usage"]["prompt_tokens"], "cached": int(details.get("cached_tokens") or 0)}


def reference_answers(model: Path, root: Path) -> dict[str, dict[str, Any]]:
    """A's and B's answers from vLLM without a connector (prefix caching off): the same chat requests."""
    job = {"model": str(model), "connector": False, "llm_kwargs": {"max_model_len": 2048},
           "phases": [{"name": sound, "chat": [chat(sound)["messages"]], "max_tokens": MAX_TOKENS, "logprobs": 1}
                      for sound in SOUNDS]}
    result = run_job(job, root)
    answers = {}
    for sound in SOUNDS:
        (out,) = phase(result, sound)["outputs"]
        chosen = [dict(map(tuple, step))[token] for step, token in zip(out["logprobs"], out["tokens"])]
        answers[sound] = {"tokens": out["tokens"], "logprobs": chosen, "prompt_tokens": out["num_prompt_tokens"],
                          "cached": out["num_cached_tokens"]}
    return answers


def cached_answers(model: Path, root: Path) -> dict[str, Any]:
    """A, A again until its chunks are stored (served from the cache), then B, through ``lmi-cache serve``."""
    root.mkdir()
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "serving.properties").write_text("\n".join([
        f"option.model_id={model}", "option.dtype=float32", "option.max_model_len=2048", "option.enforce_eager=true",
        "option.enable_prefix_caching=false", "option.enable_prompt_tokens_details=true",
        "option.lmcache_auto_config=true", "option.lmcache_max_local_cpu_size=1",
        "option.lmcache_max_local_disk_size=0", f"option.lmcache_chunk_size={CHUNK}", ""]))
    port = free_port()
    results: dict[str, Any] = {}
    with running_serve(model_dir, root, serve_env(root, port, CPU_ENV), port) as server:
        url = f"{server.url}/v1/chat/completions"
        results["A"] = answer(post(url, chat("A")))
        for _ in range(5):  # the store of A's chunks may land just after its answer
            results["A again"] = answer(post(url, chat("A")))
            if results["A again"]["cached"]:
                break
            time.sleep(0.5)
        before = metric_values(server.url, "lmi_cache_load_tokens_total")
        external_before = external_hit_tokens(server.url)
        results["B"] = answer(post(url, chat("B")))
        results["B loaded (metrics)"] = (sum(metric_values(server.url, "lmi_cache_load_tokens_total").values())
                                         - sum(before.values()))
        results["B external hits (metrics)"] = external_hit_tokens(server.url) - external_before
        results["load tokens (metrics)"] = sum(metric_values(server.url, "lmi_cache_load_tokens_total").values())
        results["log"] = server.log_tail(3000)
    return results


@pytest.fixture(scope="module")
def runs(audio_model: Path, e2e_dir: Path) -> dict[str, Any]:
    reference = reference_answers(audio_model, e2e_dir / "audio-reference")
    cached = cached_answers(audio_model, e2e_dir / "audio-serve")
    print(json.dumps({"reference": reference, "with lmi-cache": {k: v for k, v in cached.items() if k != "log"}},
                     indent=1))
    return {"reference": reference, **cached}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"]
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
    assert worst <= LOGPROB_TOLERANCE, f"logprobs moved by {worst:.2e}"


def test_the_two_sounds_give_different_answers(runs: dict[str, Any]) -> None:
    """Otherwise the test could not tell one sound's KV from the other's."""
    reference = runs["reference"]
    assert reference["A"]["prompt_tokens"] == reference["B"]["prompt_tokens"]  # the same placeholder run
    assert reference["A"]["tokens"] != reference["B"]["tokens"]


def test_a_repeated_is_served_from_the_cache_unchanged(runs: dict[str, Any]) -> None:
    assert runs["A"]["cached"] == 0
    assert_same(runs["A"], runs["reference"]["A"])
    again = runs["A again"]
    assert again["cached"] >= again["prompt_tokens"] - CHUNK, runs["log"]  # every full chunk but the last token's
    assert_same(again, runs["reference"]["A"])
    assert runs["load tokens (metrics)"] >= again["cached"] + runs["B"]["cached"]


def test_b_after_a_gets_its_own_answer_and_only_the_text_before_the_sound_hits(runs: dict[str, Any]) -> None:
    b = runs["B"]
    assert_same(b, runs["reference"]["B"])
    # The system text before the clip is the same, chunk for chunk: it is loaded; the clip's chunks are not.
    assert 0 < b["cached"] < runs["A again"]["cached"], runs["log"]
    assert runs["B loaded (metrics)"] == b["cached"] == runs["B external hits (metrics)"]
