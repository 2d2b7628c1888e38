"""LMI request schema -> vLLM completion request (pure translation, no vLLM)."""
from __future__ import annotations

import pytest

from lmi_cache.front.schema import (
    DEFAULT_MAX_NEW_TOKENS,
    LmiSchemaError,
    adapter_of,
    is_lmi_payload,
    to_completion_request,
)


def test_a_plain_lmi_request_gets_lmis_default_length_and_no_log_probs() -> None:
    out, plan = to_completion_request({"inputs": "What is Deep Learning?"})
    assert out == {"prompt": "What is Deep Learning?", "max_tokens": DEFAULT_MAX_NEW_TOKENS}
    assert plan.inputs == ("What is Deep Learning?",)
    assert not plan.batched and not plan.stream and not plan.details and plan.n == 1


def test_lmi_parameter_names_map_to_vllm_sampling_parameters() -> None:
    out, _ = to_completion_request({"inputs": "x", "parameters": {
        "max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
        "repetition_penalty": 1.1, "stop_sequences": ["\n"], "ignore_eos_token": True, "truncate": 100,
    }})
    assert out["max_tokens"] == 7 and out["temperature"] == 0.5 and out["top_p"] == 0.9
    assert out["top_k"] == 5 and out["seed"] == 3 and out["repetition_penalty"] == 1.1
    assert out["stop"] == ["\n"] and out["ignore_eos"] is True and out["truncate_prompt_tokens"] == 100


def test_stop_accepts_a_single_string() -> None:
    out, _ = to_completion_request({"inputs": "x", "parameters": {"stop": "END"}})
    assert out["stop"] == ["END"]


def test_do_sample_false_is_greedy_and_true_keeps_the_temperature() -> None:
    greedy, _ = to_completion_request({"inputs": "x", "parameters": {"do_sample": False, "temperature": 0.7}})
    assert greedy["temperature"] == 0.0
    sampled, _ = to_completion_request({"inputs": "x", "parameters": {"do_sample": True, "temperature": 0.7}})
    assert sampled["temperature"] == 0.7


def test_details_asks_vllm_for_one_log_prob_and_the_token_ids() -> None:
    out, plan = to_completion_request({"inputs": "x", "parameters": {"details": True}})
    assert out["logprobs"] == 1 and out["return_token_ids"] is True and plan.details
    assert "prompt_logprobs" not in out


def test_decoder_input_details_asks_for_prompt_log_probs_and_refuses_streaming() -> None:
    out, plan = to_completion_request({"inputs": "x", "parameters": {"details": True, "decoder_input_details": True}})
    assert out["prompt_logprobs"] == 1 and plan.prefill
    with pytest.raises(LmiSchemaError, match="decoder_input_details"):
        to_completion_request({"inputs": "x", "stream": True, "parameters": {"decoder_input_details": True}})


def test_streaming_always_asks_for_token_ids_and_log_probs() -> None:
    out, plan = to_completion_request({"inputs": "x", "stream": True})
    assert out["stream"] is True and out["logprobs"] == 1 and out["return_token_ids"] is True and plan.stream


def test_a_list_of_inputs_is_one_batched_completion() -> None:
    out, plan = to_completion_request({"inputs": ["a", "b"], "parameters": {"max_new_tokens": 2}})
    assert out["prompt"] == ["a", "b"] and plan.batched and plan.inputs == ("a", "b")


def test_return_full_text_prefixes_the_prompt_in_the_answer_not_in_the_request() -> None:
    out, plan = to_completion_request({"inputs": "Hi", "parameters": {"return_full_text": True}})
    assert "echo" not in out and plan.text_of(0, " there") == "Hi there"


def test_num_beams_turns_on_vllm_beam_search() -> None:
    out, plan = to_completion_request({"inputs": "x", "parameters": {"num_beams": 3}})
    assert out["use_beam_search"] is True and out["n"] == 3 and plan.n == 3


@pytest.mark.parametrize("params, words", [
    ({"max_new_tokenz": 3}, ["parameters.max_new_tokenz", "max_new_tokens"]),
    ({"frobnicate": 1}, ["parameters.frobnicate", "unknown parameter"]),
    ({"best_of": 2}, ["parameters.best_of", "not supported"]),
    ({"max_new_tokens": "ten"}, ["parameters.max_new_tokens", "integer"]),
    ({"temperature": "hot"}, ["parameters.temperature", "number"]),
    ({"details": "yes"}, ["parameters.details", "true or false"]),
    ({"stop_sequences": [1, 2]}, ["parameters.stop_sequences", "strings"]),
    ({"n": 0}, ["parameters.n", "at least 1"]),
])
def test_bad_parameters_are_a_400_naming_the_parameter(params: dict[str, object], words: list[str]) -> None:
    with pytest.raises(LmiSchemaError) as info:
        to_completion_request({"inputs": "x", "parameters": params})
    assert info.value.status == 400
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("body, word", [
    ({"inputs": 3}, "inputs"),
    ({"inputs": []}, "inputs"),
    ({"inputs": ["a", 1]}, "inputs"),
    ({"inputs": "x", "stream": "yes"}, "stream"),
    ({"inputs": "x", "parameters": [1]}, "parameters"),
    ({"inputs": "x", "max_tokens": 3}, "'max_tokens'"),
    ({"inputs": "x", "stream": True, "parameters": {"n": 2}}, "stream"),
])
def test_malformed_requests_are_refused_with_the_field_named(body: dict[str, object], word: str) -> None:
    with pytest.raises(LmiSchemaError, match=word):
        to_completion_request(body)


def test_only_inputs_payloads_are_lmi_payloads() -> None:
    assert is_lmi_payload({"inputs": "x"})
    assert not is_lmi_payload({"prompt": "x"})
    assert not is_lmi_payload({"messages": []})
    assert not is_lmi_payload(["inputs"])


def test_the_adapters_field_selects_the_model() -> None:
    out, _ = to_completion_request({"inputs": ["a", "b"], "adapters": ["t1", "t1"]})
    assert out["model"] == "t1"
    out, _ = to_completion_request({"inputs": "a", "adapters": "t2"})
    assert out["model"] == "t2"
    out, _ = to_completion_request({"inputs": "a", "adapters": [""]})
    assert "model" not in out  # "" is LMI's base model


def test_mixed_adapters_in_one_request_are_refused() -> None:
    with pytest.raises(LmiSchemaError, match="separate requests"):
        adapter_of({"adapters": ["t1", "t2"]}, 2)
    with pytest.raises(LmiSchemaError, match="one per input"):
        adapter_of({"adapters": ["t1", "t1"]}, 3)
    with pytest.raises(LmiSchemaError, match="adapter name"):
        adapter_of({"adapters": 5}, 1)
