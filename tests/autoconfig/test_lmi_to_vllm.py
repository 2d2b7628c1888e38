"""LMI option -> vLLM argument mapping, and the static vLLM argument table.

The table (autoconfig/data/vllm_cli_args.json) is generated from the installed
vLLM. When vLLM is upgraded, regenerate it with:

    .venv/bin/python tests/autoconfig/test_lmi_to_vllm.py > autoconfig/data/vllm_cli_args.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoconfig.lmi.names import SECRET_OPTIONS
from autoconfig.lmi.to_vllm import (
    LMI_IGNORED,
    LMI_RENAMES,
    RESERVED,
    LmiOptionError,
    flag_to_name,
    map_lmi_options,
    vllm_arg_table,
)

TABLE_PATH = Path(__file__).resolve().parents[2] / "autoconfig" / "data" / "vllm_cli_args.json"


def build_table() -> dict[str, typing.Any]:
    """Read every flag of vLLM's OpenAI server parser; engine args are EngineArgs fields."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    fields = {f.name: str(f.type) for f in dataclasses.fields(EngineArgs)}
    args: dict[str, dict[str, typing.Any]] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        long_flags = [s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")]
        entry: dict[str, typing.Any] = {"flag": long_flags[0],
                                        "group": "engine" if action.dest in fields else "frontend"}
        type_name = getattr(action.type, "__name__", "")
        field_type = fields.get(action.dest, "")
        if isinstance(action, argparse.BooleanOptionalAction):
            entry["kind"] = "bool"
        elif isinstance(action, argparse._StoreTrueAction):
            entry["kind"] = "store_true"
        elif action.nargs == "+":
            entry["kind"] = "list"
        elif type_name == "union_dict_and_str":
            entry["kind"] = "json_or_str"
        elif type_name in ("parse_dataclass", "loads", "_parse_type") or "dict" in field_type or "Config" in field_type:
            entry["kind"] = "json"
        elif type_name in ("human_readable_int", "human_readable_int_or_auto"):
            entry["kind"] = "size_or_auto" if type_name.endswith("auto") else "size"
        elif action.type is int:
            entry["kind"] = "int"
        elif action.type is float:
            entry["kind"] = "float"
        else:
            entry["kind"] = "str"
        if action.choices is not None and all(isinstance(c, str) for c in action.choices):
            entry["choices"] = sorted(action.choices)
        args[action.dest] = entry
    return {"vllm_version": vllm.__version__, "args": dict(sorted(args.items()))}


def render_table(table: dict[str, typing.Any]) -> str:
    """One argument per line, so a vLLM upgrade shows as a readable diff."""
    lines = ["{", f' "vllm_version": {json.dumps(table["vllm_version"])},', ' "args": {']
    items = list(table["args"].items())
    for i, (name, entry) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        lines.append(f"  {json.dumps(name)}: {json.dumps(entry, sort_keys=True)}{comma}")
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def vllm_parser() -> typing.Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.vllm
def test_static_table_matches_installed_vllm() -> None:
    built = build_table()
    packaged = json.loads(TABLE_PATH.read_text())
    assert packaged["vllm_version"] == built["vllm_version"], "regenerate the table (see module docstring)"
    assert packaged["args"] == built["args"], "regenerate the table (see module docstring)"


@pytest.mark.vllm
def test_every_engine_args_field_with_a_flag_is_in_the_table() -> None:
    from vllm.engine.arg_utils import EngineArgs

    table = vllm_arg_table()
    public = {f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_")}
    engine = {name for name, spec in table.items() if spec.group == "engine"}
    # EngineArgs fields without a CLI flag cannot be passed to the server at all.
    assert len(public - engine) <= 5, sorted(public - engine)
    assert engine <= public


@pytest.mark.vllm
def test_rendered_flags_parse_back_in_vllm(vllm_parser: typing.Any) -> None:
    options = {
        "tensor_parallel_degree": "2", "max_rolling_batch_size": "64", "max_rolling_batch_prefill_tokens": "4096",
        "max_model_len": "8192", "dtype": "bfloat16", "gpu_memory_utilization": "0.85",
        "enable_prefix_caching": "false", "enforce_eager": "true", "served_model_name": "a,b",
        "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
        "disable_log_stats": "true", "chat_template": "/opt/ml/model/chat.jinja",
        "override_generation_config": '{"temperature": 0.5}',
    }
    argv = map_lmi_options(options).argv()
    ns = vllm_parser.parse_args(["--model", "m", *argv])
    assert ns.tensor_parallel_size == 2
    assert ns.max_num_seqs == 64
    assert ns.max_num_batched_tokens == 4096
    assert ns.max_model_len == 8192
    assert ns.dtype == "bfloat16"
    assert ns.gpu_memory_utilization == pytest.approx(0.85)
    assert ns.enable_prefix_caching is False
    assert ns.enforce_eager is True
    assert ns.served_model_name == ["a", "b"]
    assert ns.speculative_config["num_speculative_tokens"] == 3
    assert ns.disable_log_stats is True
    assert ns.chat_template == "/opt/ml/model/chat.jinja"
    assert ns.override_generation_config == {"temperature": 0.5}


def test_lmi_names_map_to_vllm_names() -> None:
    mapped = map_lmi_options({name: "3" for name in LMI_RENAMES if name != "quantize"})
    for lmi, vllm_name in LMI_RENAMES.items():
        if lmi != "quantize":
            assert float(mapped.values[vllm_name]) == 3
            assert mapped.sources[vllm_name] == lmi
    assert map_lmi_options({"quantize": "awq"}).argv() == ["--quantization", "awq"]


def test_lmi_only_options_are_ignored_with_a_note() -> None:
    mapped = map_lmi_options({"rolling_batch": "vllm", "entryPoint": "djl_python.vllm", "engine": "Python"})
    assert mapped.values == {}
    assert len(mapped.notes) == 3
    assert any("rolling_batch=vllm" in n for n in mapped.notes)


def test_model_and_lmcache_options_are_left_to_other_modules() -> None:
    mapped = map_lmi_options({"model_id": "x", "lmcache_auto_config": "true", "lmcache_max_local_cpu_size": "4"})
    assert mapped.values == {} and mapped.notes == []


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"tensor_paralel_degree": "2"}, "did you mean option.tensor_parallel_degree?"),
        ({"lmcache_auto_confg": "true"}, "did you mean option.lmcache_auto_config?"),
        ({"max_num_seq": "2"}, "did you mean option.max_num_seqs?"),
        ({"completely_made_up": "1"}, "unknown option"),
        ({"enable_prefix_caching": "maybe"}, "expected true or false"),
        ({"max_rolling_batch_size": "lots"}, "expected an integer"),
        ({"max_rolling_batch_prefill_tokens": "4 thousand"}, "expected an integer such as 4096 or 4k"),
        ({"gpu_memory_utilization": "most"}, "expected a number"),
        ({"speculative_config": "{method: ngram}"}, "not valid JSON"),
        ({"dtype": "fp17"}, "expected one of auto, bfloat16"),
        ({"port": "9000"}, "SAGEMAKER_BIND_TO_PORT"),
        ({"tensor_parallel_degree": "2", "tensor_parallel_size": "4"}, "conflicts with"),
    ],
)
def test_bad_options_give_one_line_naming_the_option(options: dict[str, str], expected: str) -> None:
    with pytest.raises(LmiOptionError) as info:
        map_lmi_options(options, {k: f"serving.properties: option.{k}" for k in options})
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert any(f"option.{k}" in message for k in options)


def test_same_value_through_both_names_is_not_a_conflict() -> None:
    mapped = map_lmi_options({"tensor_parallel_degree": "4", "tensor_parallel_size": "4"})
    assert mapped.argv() == ["--tensor-parallel-size", "4"]


def test_tp_max_uses_the_gpu_count_when_known() -> None:
    assert map_lmi_options({"tensor_parallel_degree": "max"}, num_gpus=8).values["tensor_parallel_size"] == 8
    assert map_lmi_options({"tensor_parallel_degree": "max"}).values["tensor_parallel_size"] == "max"


def test_reserved_and_ignored_names_are_real_or_lmi_names() -> None:
    table = vllm_arg_table()
    assert set(RESERVED) <= set(table), "a reserved name no longer exists in vLLM"
    assert not set(LMI_IGNORED) & set(table), "an ignored LMI name is now a vLLM argument: map it instead"
    assert set(LMI_RENAMES.values()) <= set(table)


_SCALAR_KINDS = ("int", "float", "bool", "str")


@st.composite
def _option_sets(draw: st.DrawFn) -> dict[str, str]:
    table = vllm_arg_table()
    # Secrets travel in the environment, never argv (tested in test_serve_secrets).
    names = sorted(n for n, s in table.items()
                   if s.kind in _SCALAR_KINDS and n not in RESERVED and n not in SECRET_OPTIONS and not s.choices)
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=8))
    out = {}
    for name in chosen:
        kind = table[name].kind
        if kind == "int":
            out[name] = str(draw(st.integers(min_value=0, max_value=10**6)))
        elif kind == "float":
            out[name] = repr(draw(st.floats(min_value=0, max_value=1e6, allow_nan=False)))
        elif kind == "bool":
            out[name] = draw(st.sampled_from(["true", "false", "True", "FALSE"]))
        else:
            # A value starting with "-" is refused (it would read as a flag): tested below.
            out[name] = draw(st.text(alphabet="abcdefghij/._-0123456789", min_size=1, max_size=12)
                             .filter(lambda t: not t.startswith("-")))
    return out


@settings(max_examples=60, deadline=None)
@given(_option_sets())
def test_argv_round_trips_through_the_flag_table(options: dict[str, str]) -> None:
    mapped = map_lmi_options(options)
    names = flag_to_name()
    seen: dict[str, typing.Any] = {}
    argv = mapped.argv()
    i = 0
    while i < len(argv):
        flag = argv[i]
        if flag.startswith("--no-") and flag not in names:
            seen[names["--" + flag[5:]]] = False
            i += 1
        elif vllm_arg_table()[names[flag]].kind == "bool":
            seen[names[flag]] = True
            i += 1
        else:
            seen[names[flag]] = argv[i + 1]
            i += 2
    assert set(seen) == set(options)
    for name, raw in options.items():
        kind = vllm_arg_table()[name].kind
        if kind == "bool":
            assert seen[name] == (raw.lower() == "true")
        elif kind == "float":
            assert float(seen[name]) == float(raw)
        else:
            assert seen[name] == raw


if __name__ == "__main__":
    print(render_table(build_table()), end="")


def test_lmi_values_and_names_become_vllms() -> None:
    mapped = map_lmi_options({"dtype": "fp16", "cpu_offload_gb_per_gpu": "4"})
    assert mapped.values == {"dtype": "float16", "cpu_offload_gb": 4.0}
    assert map_lmi_options({"dtype": "BF16"}).argv() == ["--dtype", "bfloat16"]
    assert map_lmi_options({"dtype": "fp32"}).argv() == ["--dtype", "float32"]


@pytest.mark.parametrize("name", ["max_new_tokens", "async_mode", "device", "output_formatter", "enable_reasoning"])
def test_options_lmi_drops_before_vllm_are_dropped_with_a_note(name: str) -> None:
    mapped = map_lmi_options({name: "true"})
    assert mapped.values == {} and len(mapped.notes) == 1 and f"option.{name}" in mapped.notes[0]


def test_unknown_names_still_fail_with_a_did_you_mean() -> None:
    with pytest.raises(LmiOptionError, match="did you mean option.max_new_tokens"):
        map_lmi_options({"max_new_tokenz": "4"})


def test_secret_options_never_become_arguments() -> None:
    mapped = map_lmi_options({"api_key": "sk-a,sk-b", "hf_token": "hf_x"})
    assert mapped.argv() == [] and mapped.values == {}
    assert mapped.secrets == {"api_key": ["sk-a", "sk-b"], "hf_token": "hf_x"}
