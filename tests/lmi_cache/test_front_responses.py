"""vLLM completion answers -> LMI response shapes (pure translation, no vLLM)."""
from __future__ import annotations

import json
from typing import Any

from lmi_cache.front.responses import StreamTranslator, completion_to_lmi, error_to_lmi, finish_reason
from lmi_cache.front.schema import to_completion_request


def _choice(index: int, text: str, ids: list[int], reason: str | None = "length",
            stop_reason: Any = None, tokens: list[str] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "token_ids": ids, "finish_reason": reason, "stop_reason": stop_reason,
            "logprobs": {"tokens": tokens or [text], "token_logprobs": [-0.5] * len(ids)}}


def test_one_input_gives_an_object_with_generated_text_only() -> None:
    _, plan = to_completion_request({"inputs": "Q"})
    out = completion_to_lmi({"choices": [{"index": 0, "text": " A", "finish_reason": "length"}]}, plan)
    assert out == {"generated_text": " A"}


def test_a_list_of_inputs_gives_a_list_in_input_order() -> None:
    _, plan = to_completion_request({"inputs": ["Q1", "Q2"]})
    out = completion_to_lmi({"choices": [{"index": 1, "text": "two"}, {"index": 0, "text": "one"}]}, plan)
    assert out == [{"generated_text": "one"}, {"generated_text": "two"}]


def test_details_carry_lmis_fields_and_one_token_object_per_generated_token() -> None:
    _, plan = to_completion_request({"inputs": "Q", "parameters": {"details": True}})
    choice = _choice(0, " ab", [11, 12], tokens=[" a", "b"])
    out = completion_to_lmi({"choices": [choice]}, plan)
    assert out["generated_text"] == " ab"
    assert out["details"]["finish_reason"] == "length"
    assert out["details"]["generated_tokens"] == 2
    assert out["details"]["inputs"] == "Q"
    assert out["details"]["tokens"] == [{"id": 11, "text": " a", "log_prob": -0.5},
                                        {"id": 12, "text": "b", "log_prob": -0.5}]


def test_prefill_tokens_pick_the_prompt_token_of_each_position() -> None:
    _, plan = to_completion_request({"inputs": "Q", "parameters": {"details": True, "decoder_input_details": True}})
    choice = _choice(0, "x", [5])
    choice["prompt_token_ids"] = [1, 2]
    choice["prompt_logprobs"] = [None, {"9": {"logprob": -0.1, "decoded_token": "z"},
                                        "2": {"logprob": -3.0, "decoded_token": "b"}}]
    out = completion_to_lmi({"choices": [choice]}, plan)
    assert out["details"]["prefill"] == [{"id": 1, "text": None, "log_prob": None},
                                         {"id": 2, "text": "b", "log_prob": -3.0}]


def test_n_sequences_become_best_of_sequences() -> None:
    _, plan = to_completion_request({"inputs": "Q", "parameters": {"n": 2, "details": True}})
    out = completion_to_lmi({"choices": [_choice(0, "a", [1]), _choice(1, "b", [2])]}, plan)
    assert out["generated_text"] == "a"
    assert [s["generated_text"] for s in out["details"]["best_of_sequences"]] == ["b"]


def test_return_full_text_prefixes_the_prompt() -> None:
    _, plan = to_completion_request({"inputs": "Q", "parameters": {"return_full_text": True}})
    assert completion_to_lmi({"choices": [{"index": 0, "text": " A"}]}, plan) == {"generated_text": "Q A"}


def test_finish_reasons_use_lmis_names() -> None:
    assert finish_reason({"finish_reason": "length"}) == "length"
    assert finish_reason({"finish_reason": "stop", "stop_reason": None}) == "eos_token"
    assert finish_reason({"finish_reason": "stop", "stop_reason": "\n"}) == "stop_sequence"
    assert finish_reason({"finish_reason": "abort"}) == "error"
    assert finish_reason({"finish_reason": None}) is None


def test_errors_become_lmis_error_object_with_the_status() -> None:
    vllm = json.dumps({"error": {"message": "too long", "type": "BadRequestError", "code": 400}}).encode()
    assert error_to_lmi(400, vllm) == {"error": "too long", "code": 400}
    assert error_to_lmi(400, b'{"detail": "Bad request: session not found: x"}') == {
        "error": "Bad request: session not found: x", "code": 400}
    assert error_to_lmi(500, b"boom") == {"error": "boom", "code": 500}


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_a_stream_becomes_one_json_line_per_token_and_the_last_carries_the_text() -> None:
    _, plan = to_completion_request({"inputs": "Q", "stream": True, "parameters": {"details": True}})
    translator = StreamTranslator(plan)
    first = _sse({"choices": [_choice(0, " a", [7], reason=None)]})
    last = _sse({"choices": [_choice(0, "b", [8], reason="stop")]})
    raw = first + last + b"data: [DONE]\n\n"
    out = translator.feed(raw[:10]) + translator.feed(raw[10:33]) + translator.feed(raw[33:]) + translator.close()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert lines[0] == {"token": {"id": 7, "text": " a", "log_prob": -0.5}}
    assert lines[1]["token"] == {"id": 8, "text": "b", "log_prob": -0.5}
    assert lines[1]["generated_text"] == " ab"
    assert lines[1]["details"] == {"finish_reason": "eos_token", "generated_tokens": 2, "inputs": "Q"}
    assert len(lines) == 2


def test_a_streamed_error_becomes_lmis_error_line() -> None:
    _, plan = to_completion_request({"inputs": "Q", "stream": True})
    out = StreamTranslator(plan).feed(_sse({"error": {"message": "engine died"}}))
    line = json.loads(out)
    assert line["token"]["id"] == -1 and line["details"]["finish_reason"] == "error"


def test_batched_streams_say_which_input_each_line_belongs_to() -> None:
    _, plan = to_completion_request({"inputs": ["Q1", "Q2"], "stream": True})
    out = StreamTranslator(plan).feed(_sse({"choices": [_choice(1, "x", [3])]}))
    line = json.loads(out)
    assert line["index"] == 1 and line["generated_text"] == "x"
