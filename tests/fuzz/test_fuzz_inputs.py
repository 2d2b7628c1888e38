"""Property-based fuzzing of every input path: config.json, host snapshots, serving.properties, LMCache YAML/env, CLI flags.

The promise under test (README, "Reliability"): whatever the input, lmi-cache
exits 0, 1 or 2 with at most one error line and never a traceback or a hang, and
any plan it prints fits the host it was planned for. Inputs start from real
fixtures and are mutated with the values that broke parsers before (NaN,
Infinity, 1e308, huge integers, deep nesting, bad encodings, comma and relative
paths) plus arbitrary JSON and text. Example counts are in ``fuzz_support``.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from fuzz_support import (
    HOSTS, MODELS, NASTY_STRINGS, assert_clean_exit, assert_plan_within_host, count, fuzz_settings,
    json_values, load_host, nasty_text, report, run_cli,
)
from hypothesis import given
from hypothesis import strategies as st

from lmi_cache.config.cache_config import load_config
from lmi_cache.config.keys import DEPRECATED_ALIASES, EXTRA_CONFIG_KEYS, LEGACY_KEYS, LMCACHE_KEYS
from lmi_cache.errors import UserError

CONFIG_KEYS_READ = [
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "vocab_size", "num_experts", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
    "mlp_only_layers", "decoder_sparse_step", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "q_lora_rank", "max_position_embeddings", "sliding_window", "use_sliding_window", "torch_dtype", "dtype",
    "quantization_config", "text_config", "model_type", "tie_word_embeddings", "multi_query", "layer_types",
    "n_head_kv", "num_kv_heads", "hidden_size_per_head", "shared_expert_intermediate_size", "n_routed_experts",
]
BASE_MODELS = ["qwen2.5-0.5b-instruct", "llama-3.1-8b-instruct", "deepseek-v3", "qwen3-30b-a3b", "gemma-2-9b-it"]
HOST_FILES = ["a100x8_nvme_cgroup.json", "cpu_only_rotational.json", "a10g_container_memlock.json"]


# ---------------------------------------------------------------- config.json


@st.composite
def config_files(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 19)) == 0:  # now and then: raw bytes, not JSON at all
        return draw(st.binary(max_size=64))
    base = json.loads((MODELS / draw(st.sampled_from(BASE_MODELS)) / "config.json").read_text())
    for key, value in draw(st.dictionaries(st.sampled_from(CONFIG_KEYS_READ), json_values, max_size=4)).items():
        base[key] = value
    if draw(st.booleans()):
        base.pop(draw(st.sampled_from(CONFIG_KEYS_READ)), None)
    return json.dumps(base, allow_nan=True).encode()


@fuzz_settings(250)
@given(raw=config_files(), tp=st.sampled_from(["1", "2", "3", "8"]), host_file=st.sampled_from(HOST_FILES))
def test_fuzz_config_json(raw: bytes, tp: str, host_file: str) -> None:
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_bytes(raw)
        result = run_cli(["plan", "--model", model_dir, "--tp", tp, "--host-snapshot", str(HOSTS / host_file), "--json"])
    count("config.json", f"exit {result.exit_code}")
    assert_clean_exit(result, (0, 2))
    if result.exit_code == 0:
        assert_plan_within_host(json.loads(result.output), load_host(host_file))


# ---------------------------------------------------------------- host snapshots

HOST_FIELDS = {
    "memory": ["total_bytes", "available_bytes", "cgroup_limit_bytes", "memlock_limit_bytes", "shm_bytes",
               "cgroup_usage_bytes"],
    "gpus": ["index", "name", "memory_total_bytes", "memory_free_bytes"],
    "disks": ["mount", "device", "fs_type", "total_bytes", "free_bytes", "rotational", "nvme", "odirect", "writable",
              "is_tmpfs", "is_overlay", "is_network"],
}
_byte_counts = st.one_of(st.integers(min_value=0, max_value=2**40), st.integers(min_value=0, max_value=2**64),
                        st.sampled_from([0, 1, 2**63 - 1, 2**64, 10**400]))
_WELL_TYPED = {
    "mount": st.sampled_from(["/", "/tmp", "/mnt/a,b", "/data", "/proc", "/dev/shm", "/nvme", "relative/dir", ""]),
    "fs_type": st.sampled_from(["xfs", "ext4", "tmpfs", "nfs", "proc", "overlay", "fuse.s3fs"]),
    "device": st.sampled_from(["/dev/nvme0n1", "tmpfs", "overlay", ""]),
    "name": st.text(max_size=12),
    "index": st.integers(min_value=0, max_value=64),
    "rotational": st.one_of(st.none(), st.booleans()),
    "odirect": st.one_of(st.none(), st.booleans()),
    "cgroup_limit_bytes": st.one_of(st.none(), _byte_counts),
    "memlock_limit_bytes": st.one_of(st.none(), _byte_counts),
    "cgroup_usage_bytes": st.one_of(st.none(), _byte_counts),
}
_FLAGS = {"nvme", "writable", "is_tmpfs", "is_overlay", "is_network"}
garbage = st.one_of(json_values, nasty_text)


def host_value(field: str) -> st.SearchStrategy[Any]:
    """Five times in six a value of the field's own type (so plans happen and get checked), else garbage."""
    typed = _WELL_TYPED.get(field, st.booleans() if field in _FLAGS else _byte_counts)
    return st.one_of(typed, typed, typed, typed, typed, garbage)


@st.composite
def host_snapshots(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    name = draw(st.sampled_from(HOST_FILES))
    data = load_host(name)
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(HOST_FIELDS)))
        field = draw(st.sampled_from(HOST_FIELDS[section]))
        value = draw(host_value(field))
        if section == "memory":
            data["memory"][field] = value
        elif data[section]:
            data[section][draw(st.integers(0, len(data[section]) - 1))][field] = value
    if draw(st.integers(0, 19)) == 0:
        data[draw(st.sampled_from(["gpus", "disks", "memory", "cpu_count"]))] = draw(json_values)
    if data.get("disks") and isinstance(data["disks"], list) and draw(st.integers(0, 3)) == 0:
        # Seeds from inputs that broke earlier versions: the best disk behind a comma or a
        # relative mount point, and byte counts too large for a float.
        best = data["disks"][0]
        if isinstance(best, dict):
            best.update({"mount": draw(st.sampled_from(["/mnt/a,b", "relative/nvme", ""])), "nvme": True,
                         "rotational": False, "fs_type": "xfs", "free_bytes": 2**42, "total_bytes": 2**43})
    if draw(st.integers(0, 7)) == 0 and isinstance(data.get("memory"), dict):
        data["memory"][draw(st.sampled_from(HOST_FIELDS["memory"]))] = 10**400
    return data, json.dumps(data, allow_nan=True).encode()


@fuzz_settings(250)
@given(snapshot=host_snapshots(), tp=st.sampled_from(["1", "2", "8"]), disk_size=st.sampled_from([None, "0", "50"]))
def test_fuzz_host_snapshot(snapshot: tuple[dict[str, Any], bytes], tp: str, disk_size: str | None) -> None:
    data, raw = snapshot
    with tempfile.TemporaryDirectory() as tmp:
        host_file = Path(tmp, "host.json")
        host_file.write_bytes(raw)
        args = ["plan", "--model", str(MODELS / "qwen2.5-0.5b-instruct"), "--tp", tp, "--host-snapshot", str(host_file), "--json"]
        result = run_cli(args + (["--disk-size-gib", disk_size] if disk_size else []))
    count("host snapshot", f"exit {result.exit_code}")
    assert_clean_exit(result, (0, 2))
    if result.exit_code == 0:
        assert_plan_within_host(json.loads(result.output), data)


# ---------------------------------------------------------------- serving.properties + OPTION_* env

OPTION_NAMES = [
    "tensor_parallel_degree", "pipeline_parallel_degree", "data_parallel_degree", "max_model_len",
    "lmcache_auto_config", "lmcache_config_file", "lmcache_max_local_cpu_size", "lmcache_max_local_disk_size",
    "lmcache_local_disk", "lmcache_chunk_size", "lmcache_use_odirect", "dtype", "kv_cache_dtype",
    "gpu_memory_utilization", "max_rolling_batch_size", "max_rolling_batch_prefill_tokens", "model_id",
    "served_model_name", "api_key", "kv_transfer_config", "rolling_batch", "entryPoint", "trust_remote_code",
    "speculative_config", "cpu_offload_gb_per_gpu", "max_new_tokens", "enable_prefix_caching", "optoin_typo",
]
_GOOD_OPTION_VALUES = ["1", "2", "4096", "true", "false", "auto", "bf16", "fp16", "0.9", "0.5", "10", "256",
                       "/tmp/lmcache-fuzz", "max", "vllm", "lmi-dist"]
# JSON-valued options get JSON that broke parsers before: too deep, a number too long, not JSON at all.
_JSON_OPTIONS = ["kv_transfer_config", "speculative_config", "served_model_name", "compilation_config"]
_BAD_JSON = ["[" * 3000 + "]" * 3000, '{"a": ' * 3000 + "1" + "}" * 3000, '{"a": ' + "9" * 5000 + "}", "[1, 2", "{",
             '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "[\"a\", \"--host\"]", "null", "[]"]
property_lines = st.one_of(
    st.builds(lambda k, v: f"option.{k}={v}", st.sampled_from(_JSON_OPTIONS), st.sampled_from(_BAD_JSON)),
    st.builds(lambda k, v: f"option.{k}={v}", st.sampled_from(OPTION_NAMES), st.sampled_from(_GOOD_OPTION_VALUES)),
    st.builds(lambda k, v: f"option.{k}={v}", st.sampled_from(OPTION_NAMES), st.sampled_from(_GOOD_OPTION_VALUES)),
    st.builds(lambda k, v: f"option.{k}={v}", st.sampled_from(OPTION_NAMES), nasty_text),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["engine", "job_queue_size", "option", "option.", "="]),
              nasty_text),
    st.text(max_size=30),
)


@fuzz_settings(150)
@given(lines=st.lists(property_lines, max_size=5), auto=st.booleans(),
       env=st.dictionaries(st.sampled_from(["OPTION_TENSOR_PARALLEL_DEGREE", "OPTION_MAX_MODEL_LEN", "SM_NUM_GPUS",
                                            "TENSOR_PARALLEL_DEGREE", "LMCACHE_CHUNK_SIZE", "OPTION_LMCACHE_LOCAL_DISK",
                                            "LMCACHE_CONFIG_FILE", "HF_MODEL_ID", "MAX_BATCH_SIZE"]),
                           st.sampled_from(NASTY_STRINGS), max_size=3),
       host_file=st.sampled_from(HOST_FILES))
def test_fuzz_serving_properties(lines: list[str], auto: bool, env: dict[str, str], host_file: str) -> None:
    text = "\n".join(lines + (["option.lmcache_auto_config=true"] if auto else []))
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as runtime:
        config = (MODELS / "llama-3.1-8b-instruct" / "config.json").read_text()  # 32 heads: TP 1-8 all divide
        Path(model_dir, "config.json").write_text(config)
        Path(model_dir, "serving.properties").write_text(text, encoding="utf-8", errors="surrogateescape")
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "LMCACHE_", "HF_", "SM_"))}
        with mock.patch.dict(os.environ, {**clean, **env, "LMI_CACHE_RUNTIME_DIR": runtime}, clear=True):
            result = run_cli(["serve", "--dry-run", "--model-dir", model_dir, "--host-snapshot", str(HOSTS / host_file)])
        written = sorted(p.name for p in Path(runtime).iterdir())
    count("serving.properties", f"exit {result.exit_code}")
    assert_clean_exit(result, (0, 2))
    assert written == [], f"--dry-run wrote {written}"


# ---------------------------------------------------------------- LMCache YAML + LMCACHE_* env

YAML_KEYS = sorted(LMCACHE_KEYS) + sorted(DEPRECATED_ALIASES) + sorted(LEGACY_KEYS) + ["chunk_sise", "async_loading"]
yaml_values = st.one_of(json_values, st.dictionaries(st.sampled_from(sorted(EXTRA_CONFIG_KEYS) + ["s3_region"]),
                                                     json_values, max_size=3))


@st.composite
def yaml_files(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=80))
    if kind == 1:
        return draw(st.text(max_size=80)).encode("utf-8", "surrogatepass")
    if kind == 2:  # a YAML alias bomb (9^6 leaves) under a real key: no message may expand it
        anchors = "".join(f"{k}: &{c} [{', '.join([p] * 9)}]\n" for k, c, p in zip(
            ["blend_check_layers", "p2p_init_ports", "p2p_lookup_ports", "lmcache_worker_ids", "pd_peer_init_port",
             "nixl_backends"], "abcdef", ['"lol"', "*a", "*b", "*c", "*d", "*e"]))
        return (anchors + f"{draw(st.sampled_from(YAML_KEYS))}: *f\n").encode()
    if kind == 3:  # the same inside extra_config (9^8 leaves), read by a key of ours, or a key written twice
        bomb = "".join(f"  {c}: &{c} [{', '.join([p] * 9)}]\n" for c, p in zip("abcdefgh", ['"lol"'] + [
            f"*{c}" for c in "abcdefg"]))
        key = draw(st.sampled_from(sorted(EXTRA_CONFIG_KEYS)))
        return (f"chunk_size: 256\nextra_config:\n{bomb}  {key}: *h\n" if draw(st.booleans())
                else f"chunk_size: 256\n{key}: 1\n{key}: 2\n").encode()
    data = draw(st.dictionaries(st.sampled_from(YAML_KEYS), yaml_values, max_size=6))
    return yaml.safe_dump(data, allow_unicode=True).encode("utf-8", "surrogatepass")


env_names = st.sampled_from([f"LMCACHE_{k.upper()}" for k in ("chunk_size", "local_disk", "max_local_disk_size",
                                                               "max_local_cpu_size", "extra_config", "remote_url",
                                                               "local_cpu", "cache_policy", "chunk_siz", "nixl_role")])


@fuzz_settings(400)
@given(raw=yaml_files(), env=st.dictionaries(env_names, nasty_text, max_size=3))
def test_fuzz_lmcache_yaml_and_env(raw: bytes, env: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "lmcache.yaml")
        path.write_bytes(raw)
        try:
            config, warnings = load_config(str(path), env=env)
        except UserError as err:
            count("LMCache YAML/env", "refused")
            assert "\n" not in str(err) and str(err).strip()
        else:  # what the engine will allocate is bounded: no overflow, no 100,000 threads
            count("LMCache YAML/env", "accepted")
            assert 0 <= config.cpu_capacity_bytes <= (1 << 50) and 0 <= config.disk_capacity_bytes <= (1 << 50)
            assert 1 <= config.disk_write_workers <= 64 and 1 <= config.disk_read_workers <= 64
            assert all(p.startswith("/") and "," not in p for p in config.local_disk)
            assert all("\n" not in w for w in warnings)


@fuzz_settings(150)
@given(raw=yaml_files(), tp=st.sampled_from(["1", "2", "8"]), host_file=st.sampled_from(HOST_FILES))
def test_fuzz_validate_cli(raw: bytes, tp: str, host_file: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "lmcache.yaml")
        path.write_bytes(raw)
        result = run_cli(["validate", str(path), "--model", str(MODELS / "llama-3.1-8b-instruct"), "--tp", tp,
                          "--host-snapshot", str(HOSTS / host_file)])
    count("validate CLI", f"exit {result.exit_code}")
    assert_clean_exit(result, (0, 1, 2))


# ---------------------------------------------------------------- CLI flags

FLAG_VALUES = {
    "--tp": ["1", "2", "3", "8", "0", "-1", "1e3", "4096", "4097", "nan"],
    "--pp": ["1", "2", "100", "0"],
    "--dp": ["1", "2", "8", "0", "99999"],
    "--max-model-len": ["1", "512", "131072", "1099511627776", "1099511627777", "0", "nan"],
    "--chunk-size": ["1", "16", "256", "255", "65536", "65537", "0", "-5"],
    "--cpu-size-gib": ["0", "1", "0.5", "1e6", "nan", "inf", "-inf", "1e308", "-1", "x"],
    "--disk-size-gib": ["0", "10", "1e308", "nan", "inf"],
    "--disk-path": ["/tmp/lmcache", "/proc/lmcache", "/mnt/a,b", "relative", "", "file:///nvme/kv/", "/nvme"],
    "--gpu-memory-utilization": ["0.9", "1", "0", "1.5", "nan", "inf", "-0.1"],
    "--kv-cache-dtype": ["auto", "fp8", "nvfp4", "bogus", ""],
    "--dtype": ["auto", "fp16", "float16", "bfloat16", "bogus"],
    "--engine": ["lmi_cache", "lmcache", "other"],
    "--instance-type": ["ml.p4de.24xlarge", "ml.g6e.12xlarge", "ml.nope"],
}


@st.composite
def plan_argv(draw: st.DrawFn) -> tuple[list[str], str | None]:
    args = ["plan", "--model", str(MODELS / draw(st.sampled_from(BASE_MODELS)))]
    host_file = None
    if draw(st.booleans()):
        host_file = draw(st.sampled_from(HOST_FILES))
        args += ["--host-snapshot", str(HOSTS / host_file)]
    for flag in draw(st.lists(st.sampled_from(sorted(FLAG_VALUES)), max_size=5, unique=True)):
        if flag == "--instance-type" and host_file is not None:
            continue
        args += [flag, draw(st.sampled_from(FLAG_VALUES[flag]))]
    if host_file is None and "--instance-type" not in args:
        host_file = "a100x8_nvme_cgroup.json"
        args += ["--host-snapshot", str(HOSTS / host_file)]
    return args + ["--json"], host_file


@fuzz_settings(300)
@given(argv=plan_argv())
def test_fuzz_plan_flags(argv: tuple[list[str], str | None]) -> None:
    args, host_file = argv
    result = run_cli(args)
    count("plan flags", f"exit {result.exit_code}")
    assert_clean_exit(result, (0, 2))
    if result.exit_code == 0 and host_file is not None:
        assert_plan_within_host(json.loads(result.output), load_host(host_file))


DEPLOY_FLAGS = {
    "--name": ["kv-demo", "", "a" * 80, "bad name!", "x"],
    "--image": ["123456789012.dkr.ecr.us-east-1.amazonaws.com/lmi-cache:1", "", "not an image", "nginx"],
    "--model-data": ["s3://bucket/model/", "s3://bucket/model.tar.gz", "s3://", "/local/path", ""],
    "--instance-type": ["ml.g6e.12xlarge", "ml.p4d.24xlarge", "ml.nope", "", "ml.g5.xlarge"],
    "--role": ["arn:aws:iam::123456789012:role/SageMakerRole", "arn:aws:iam::1:role/r", "", "role"],
    "--option": ["tensor_parallel_degree=4", "tensor_parallel_degree=64", "max_model_len=nan", "=x", "noequals",
                 "hf_token=hf_secret", "lmcache_auto_config=true", "optoin=1"],
    "--env": ["HF_TOKEN=hf_secret", "X=", "=y", "noequals", "LMCACHE_CHUNK_SIZE='512'"],
    "--instance-count": ["1", "0", "-1", "1e3", "99999999999999999999"],
    "--startup-timeout": ["60", "3600", "3601", "0", "nan"],
    "--region": ["us-east-1", "", "mars-1"],
}


@st.composite
def deploy_argv(draw: st.DrawFn) -> list[str]:
    """A valid deploy command (first value of each flag) with a few flags changed, dropped or repeated."""
    values = {flag: [choices[0]] for flag, choices in DEPLOY_FLAGS.items()}
    for flag in draw(st.lists(st.sampled_from(sorted(DEPLOY_FLAGS)), max_size=4)):
        change = draw(st.integers(0, 5))
        if change == 0:
            values.pop(flag, None)
        else:
            new = draw(st.one_of(st.sampled_from(DEPLOY_FLAGS[flag]), nasty_text))
            values[flag] = values.get(flag, []) + [new] if change == 1 else [new]
    args = ["sagemaker", "deploy", "--dry-run"]
    for flag, items in values.items():
        for item in items:
            args += [flag, item]
    return args


@fuzz_settings(150)
@given(args=deploy_argv())
def test_fuzz_sagemaker_deploy_flags(args: list[str]) -> None:
    result = run_cli(args, env={"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
    count("sagemaker deploy flags", f"exit {result.exit_code}")
    assert_clean_exit(result, (0, 2))
    assert "hf_secret" not in result.output  # secrets are never printed


def test_zz_report_case_counts() -> None:
    """Prints how many generated cases each target ran (pytest -s shows it; the README quotes it)."""
    print("\nfuzz cases: " + report())
