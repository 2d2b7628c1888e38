"""LMI/TGI request schema on ``/invocations`` -> a vLLM OpenAI completion request (pure).

Runs in vLLM's API server process (called by the front middleware) and in
tests. The schema is LMI's "Rolling Batch/Continuous Batch Schema" and its
"Dynamic Batch" list form, as documented in djl-serving
``serving/docs/lmi/user_guides/lmi_input_output_schema.md`` (the v0.31.0 page:
GenerationParameters and "Additional vLLM Generation Parameters"). The
parameter mapping follows LMI's own vLLM handler
(``engines/python/setup/djl_python/lmi_vllm/request_response_utils.py``,
``convert_lmi_schema_to_completion_request``): ``max_new_tokens`` defaults to
30, ``do_sample=false`` means greedy, ``details`` asks vLLM for log-probs,
``return_full_text`` prefixes the prompt. Unlike LMI, unknown parameters are
refused with a 400 naming them instead of being passed on to vLLM (which
would ignore them silently).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

# LMI's default when max_new_tokens is absent (the schema page and LMI's vLLM handler).
DEFAULT_MAX_NEW_TOKENS = 30
TOP_LEVEL_KEYS = frozenset({"inputs", "parameters", "stream", "adapters", "model"})


class LmiSchemaError(ValueError):
    """A request the LMI schema refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LmiSchemaError(f"parameters.{name}: expected an integer, got {value!r}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LmiSchemaError(f"parameters.{name}: expected a number, got {value!r}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise LmiSchemaError(f"parameters.{name}: expected true or false, got {value!r}")
    return value


def _str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise LmiSchemaError(f"parameters.{name}: expected a string or a list of strings, got {value!r}")


def _int_list(name: str, value: Any) -> list[int]:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise LmiSchemaError(f"parameters.{name}: expected a list of integers, got {value!r}")


# LMI parameter -> (vLLM CompletionRequest field, value check). Same-named
# vLLM parameters are LMI's "Additional vLLM Generation Parameters".
_SIMPLE: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_new_tokens": ("max_tokens", _int),
    "temperature": ("temperature", _float),
    "top_p": ("top_p", _float),
    "top_k": ("top_k", _int),
    "min_p": ("min_p", _float),
    "seed": ("seed", _int),
    "repetition_penalty": ("repetition_penalty", _float),
    "presence_penalty": ("presence_penalty", _float),
    "frequency_penalty": ("frequency_penalty", _float),
    "length_penalty": ("length_penalty", _float),
    "n": ("n", _int),
    "stop_sequences": ("stop", _str_list),
    "stop": ("stop", _str_list),
    "stop_token_ids": ("stop_token_ids", _int_list),
    "include_stop_str_in_output": ("include_stop_str_in_output", _bool),
    "ignore_eos_token": ("ignore_eos", _bool),
    "ignore_eos": ("ignore_eos", _bool),
    "truncate": ("truncate_prompt_tokens", _int),
    "min_tokens": ("min_tokens", _int),
    "skip_special_tokens": ("skip_special_tokens", _bool),
    "spaces_between_special_tokens": ("spaces_between_special_tokens", _bool),
    "logprobs": ("logprobs", _int),
    "prompt_logprobs": ("prompt_logprobs", _int),
}
# Parameters the front itself interprets.
_FRONT = frozenset({"do_sample", "details", "decoder_input_details", "return_full_text", "num_beams"})
# Documented by LMI but without a vLLM 0.32 counterpart: refused with the reason.
_UNSUPPORTED = {
    "best_of": "vLLM 0.32 removed best_of; use n",
    "early_stopping": "vLLM 0.32's beam search has no early_stopping",
    "top_n_tokens": "use details=true (one log-prob per token) or logprobs",
    "watermark": "vLLM has no watermarking",
    "typical_p": "vLLM has no typical sampling",
}
KNOWN_PARAMETERS = frozenset(_SIMPLE) | _FRONT


@dataclass(frozen=True)
class LmiRequestPlan:
    """What the response translation needs to know about the LMI request."""

    inputs: tuple[str, ...]
    batched: bool  # "inputs" was a list: answer with a list
    stream: bool
    details: bool
    prefill: bool  # decoder_input_details
    full_text: bool  # return_full_text
    n: int  # sequences per input

    def text_of(self, index: int, generated: str) -> str:
        return self.inputs[index] + generated if self.full_text else generated


def is_lmi_payload(body: Any) -> bool:
    """LMI's schema is the one with ``inputs``; OpenAI payloads use ``prompt`` / ``messages``."""
    return isinstance(body, dict) and "inputs" in body and "prompt" not in body and "messages" not in body


def adapter_of(body: dict[str, Any], num_inputs: int = 1) -> str | None:
    """The adapter an ``"adapters"`` field names (a string, or one per input that must agree)."""
    raw = body.get("adapters")
    if raw is None:
        return None
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names or not all(isinstance(a, str) for a in names):
        raise LmiSchemaError(f"adapters: expected an adapter name or a list of names, got {raw!r}")
    if len(set(names)) > 1:
        raise LmiSchemaError("adapters: one request serves one adapter here; send the inputs of different "
                             f"adapters as separate requests (got {sorted(set(names))})")
    if isinstance(raw, list) and len(names) not in (1, num_inputs):
        raise LmiSchemaError(f"adapters: {len(names)} names for {num_inputs} inputs; give one per input or one")
    return names[0] or None  # "" is LMI's way to ask for the base model


def to_completion_request(body: dict[str, Any]) -> tuple[dict[str, Any], LmiRequestPlan]:
    """Translate an LMI payload to vLLM's ``CompletionRequest`` JSON; raise LmiSchemaError when it is wrong."""
    unknown = sorted(set(body) - TOP_LEVEL_KEYS)
    if unknown:
        raise LmiSchemaError(f"unknown field {unknown[0]!r} in an LMI request; the schema takes "
                             "inputs, parameters, stream and adapters")
    inputs = body["inputs"]
    if isinstance(inputs, str):
        prompts, batched = [inputs], False
    elif isinstance(inputs, list) and inputs and all(isinstance(p, str) for p in inputs):
        prompts, batched = list(inputs), True
    else:
        raise LmiSchemaError("inputs: expected a string or a non-empty list of strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise LmiSchemaError(f"stream: expected true or false, got {stream!r}")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise LmiSchemaError(f"parameters: expected an object, got {params!r}")
    out: dict[str, Any] = {"prompt": prompts if batched else prompts[0], "max_tokens": DEFAULT_MAX_NEW_TOKENS}
    for name, value in params.items():
        if name in _UNSUPPORTED:
            raise LmiSchemaError(f"parameters.{name}: not supported ({_UNSUPPORTED[name]})")
        if name in _FRONT:
            continue
        if name not in _SIMPLE:
            hint = difflib.get_close_matches(name, sorted(KNOWN_PARAMETERS), n=1)
            did = f"; did you mean {hint[0]!r}?" if hint else ""
            raise LmiSchemaError(f"parameters.{name}: unknown parameter{did} "
                                 f"(accepted: {', '.join(sorted(KNOWN_PARAMETERS))})")
        target, check = _SIMPLE[name]
        if value is None:
            continue
        out[target] = check(name, value)
    do_sample = params.get("do_sample")
    if do_sample is not None and not _bool("do_sample", do_sample):
        out["temperature"] = 0.0
    details = _bool("details", params.get("details", False))
    prefill = _bool("decoder_input_details", params.get("decoder_input_details", False))
    full_text = _bool("return_full_text", params.get("return_full_text", False))
    num_beams = params.get("num_beams")
    if num_beams is not None and _int("num_beams", num_beams) > 1:
        out["use_beam_search"] = True
        out["n"] = num_beams
    n = out.get("n", 1)
    if n < 1:
        raise LmiSchemaError(f"parameters.n: must be at least 1, got {n}")
    if stream and n > 1:
        raise LmiSchemaError("parameters.n / num_beams > 1 cannot stream (LMI: non-streaming only)")
    if prefill and stream:
        raise LmiSchemaError("parameters.decoder_input_details cannot be used with streaming (as in LMI)")
    if details or stream:
        # One log-prob per generated token (LMI's Token.log_prob) and the ids themselves.
        out["logprobs"] = max(1, out.get("logprobs") or 0)
        out["return_token_ids"] = True
    if prefill:
        out["prompt_logprobs"] = max(1, out.get("prompt_logprobs") or 0)
        out["return_token_ids"] = True
    if stream:
        out["stream"] = True
    adapter = adapter_of(body, len(prompts))
    if adapter is not None:
        out["model"] = adapter
    elif isinstance(body.get("model"), str):
        out["model"] = body["model"]
    plan = LmiRequestPlan(tuple(prompts), batched, stream, details, prefill, full_text, n)
    return out, plan
