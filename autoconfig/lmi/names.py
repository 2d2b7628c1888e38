"""AWS LMI's names, values and environment variables, and what each becomes here.

Pure tables read at container start by ``autoconfig.lmi.properties`` (settings and
environment variables) and ``autoconfig.lmi.to_vllm`` (option -> vLLM
argument). Each table cites the LMI source it follows, in the public
``deepjavalibrary/djl-serving`` repository (LMI containers are built from it):

- engines/python/setup/djl_python/properties_manager/vllm_rb_properties.py
  (renames such as ``cpu_offload_gb_per_gpu``, the dtype values, and that LMI
  hands vLLM only the names vLLM's EngineArgs defines: everything else is
  dropped there), and properties.py beside it (LMI's own fields);
- serving/docs/lmi/user_guides/starting-guide.md (the simplified environment
  variables and their defaults: ``TENSOR_PARALLEL_DEGREE`` defaults to ``max``);
- serving/docker/dockerd-entrypoint-with-cuda-compat.sh (``translateTGIToLMI``:
  a SageMaker/TGI variable fills an LMI one only when that one is unset);
- serving/docs/lmi/deployment_guide/configurations.md (server keys without the
  ``option.`` prefix; "LMI will attempt to maximize the number of model
  workers based on available GPUs").
"""
from __future__ import annotations

from typing import Any

from lmi_cache.front.options import FRONT_OPTIONS

# LMI names that vLLM spells differently.
LMI_RENAMES: dict[str, str] = {
    "tensor_parallel_degree": "tensor_parallel_size",
    "pipeline_parallel_degree": "pipeline_parallel_size",
    "max_rolling_batch_size": "max_num_seqs",
    "max_rolling_batch_prefill_tokens": "max_num_batched_tokens",
    "data_parallel_degree": "data_parallel_size",
    "quantize": "quantization",
    "cpu_offload_gb_per_gpu": "cpu_offload_gb",
}

# LMI values that vLLM spells differently (vllm_rb_properties.py DTYPE_MAPPER).
LMI_VALUES: dict[str, dict[str, str]] = {
    "dtype": {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"},
}

_SERVER = "this container always serves with vLLM's OpenAI server"
# LMI options with no vLLM counterpart: LMI consumes them itself (or drops
# them before vLLM), so a file copied from an LMI deployment must start here:
# each is dropped with a note saying why.
LMI_IGNORED: dict[str, str] = {
    "rolling_batch": "vLLM always batches continuously",
    "entryPoint": _SERVER,
    "entrypoint": _SERVER,
    "engine": "this container always runs vLLM",
    "async_mode": _SERVER,
    "mpi_mode": "vLLM starts its own workers",
    "job_queue_size": "vLLM queues requests itself",
    "batch_size": "use max_rolling_batch_size",
    "max_batch_delay": "vLLM batches continuously",
    "model_loading_timeout": "no model-server timeout here; the SageMaker health check bounds start-up",
    "predict_timeout": "no model-server timeout here",
    "output_formatter": "/invocations answers in LMI's default formats (JSON; jsonlines when streaming); "
                        "a custom formatter is an @output_formatter in adapters/<name>/model.py "
                        "(with option.enable_adapter_formatters=true)",
    "input_formatter": "/invocations reads LMI's schema and OpenAI's; a custom formatter is an "
                       "@input_formatter in adapters/<name>/model.py (with option.enable_adapter_formatters=true)",
    "device_map": "vLLM places the model itself",
    "device": "vLLM uses the platform it was built for",
    "load_on_devices": "vLLM uses all visible devices",
    "parallel_loading": "vLLM loads ranks in parallel",
    "task": "vLLM infers the task from the model",
    "enable_streaming": "a request streams when it sends \"stream\": true (LMI's jsonlines on /invocations)",
    "tgi_compat": "/invocations answers in LMI's shapes (an object per input, jsonlines streams), "
                  "not TGI's (a list, server-sent events)",
    "bedrock_compat": "the OpenAI server has its own schema",
    "s3url": "mount or download the model into the model directory",
    "max_new_tokens": "a request sets max_tokens; LMI uses this only as its own default",
    "waiting_steps": "vLLM schedules prefills itself",
    "cluster_size": "multi-node LMI is not supported here; one host serves the model",
    "adapters": "the model directory's adapters/ folder is what is served (with option.enable_lora=true)",
    "draft_model_id": "use option.speculative_config",
    "spec_length": "use option.speculative_config",
}

# LMI options the front door reads itself (sessions: djl-serving
# serving/docs/stateful_sessions.md; adapter formatters): valid names that are
# never handed to vLLM, listed here so that a misspelling gets a did-you-mean.
FRONT_OPTION_NAMES: frozenset[str] = FRONT_OPTIONS

# vLLM arguments LMI passed to the vLLM versions it shipped but that vLLM 0.32
# no longer has; LMI's passthrough drops a name EngineArgs lacks, so do we.
REMOVED_VLLM_ARGS: dict[str, str] = {
    "enable_reasoning": "vLLM 0.32 turns reasoning output on with option.reasoning_parser alone",
    "use_v2_block_manager": "vLLM 0.32 has one block manager",
    "long_lora_scaling_factors": "vLLM 0.32 removed long-context LoRA scaling",
    "speculative_draft_model": "use option.speculative_config",
    "record_acceptance_rate": "vLLM 0.32 reports speculative acceptance in its metrics",
    "max_rolling_batch_prefill_tokens_auto": "vLLM chooses max_num_batched_tokens itself",
}

# Options that hold a secret: never on argv, never printed. vLLM reads each
# from an environment variable (vllm/envs.py VLLM_API_KEY; huggingface_hub HF_TOKEN).
SECRET_OPTIONS: dict[str, str] = {"api_key": "VLLM_API_KEY", "hf_token": "HF_TOKEN"}
SECRET_ENV_VARS = frozenset({"VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY",
                             "AWS_SESSION_TOKEN"})
# Whole words of a name (split at "_"): ``hf_token`` and ``aws_secret_key`` are
# secrets, ``max_num_batched_tokens`` and ``ssl_keyfile`` (a path) are not.
_SECRET_WORDS = frozenset({"token", "key", "secret", "password", "passwd", "credential", "credentials"})

# LMI's simplified environment variables (starting-guide.md; the entrypoint's
# translateTGIToLMI): each fills the option only when neither serving.properties
# nor OPTION_<NAME> sets it; earlier rows win over later rows for the same option.
SIMPLIFIED_ENV: tuple[tuple[str, str], ...] = (
    ("HF_MODEL_ID", "model_id"),
    ("HF_REVISION", "revision"),
    ("HF_MODEL_TRUST_REMOTE_CODE", "trust_remote_code"),
    ("TENSOR_PARALLEL_DEGREE", "tensor_parallel_degree"),
    ("SM_NUM_GPUS", "tensor_parallel_degree"),
    ("MAX_BATCH_SIZE", "max_rolling_batch_size"),
    ("MAX_BATCH_PREFILL_TOKENS", "max_rolling_batch_prefill_tokens"),
    ("HF_MODEL_QUANTIZE", "quantize"),
    ("MAX_CONCURRENT_REQUESTS", "job_queue_size"),
)

# DJL Serving keys without the ``option.`` prefix that LMI files carry
# (configurations.md, configurations_model.md); they configure LMI's Java front
# end, which this container replaces, so they are noted and ignored.
SERVER_KEYS = frozenset({
    "engine", "job_queue_size", "batch_size", "max_batch_delay", "max_idle_time", "minWorkers", "maxWorkers",
    "gpu.minWorkers", "gpu.maxWorkers", "cpu.minWorkers", "cpu.maxWorkers", "load_on_devices", "load_on_device",
    "required_memory_mb", "reserved_memory_mb", "gpu.required_memory_mb", "gpu.reserved_memory_mb",
    "log_model_metric", "metrics_aggregation", "model_loading_timeout", "predict_timeout", "pooling",
    "reranking", "normalize", "translatorFactory", "translator", "application", "blockDecodeTimeout",
})


# Server keys that still mean something here.
SERVER_KEYS_USED: dict[str, str] = {
    "load_on_devices": "the GPUs vLLM may use (CUDA_VISIBLE_DEVICES)",
    "load_on_device": "the GPUs vLLM may use (CUDA_VISIBLE_DEVICES)",
    "maxWorkers": "caps the number of model copies (data parallel replicas)",
    "gpu.maxWorkers": "caps the number of model copies (data parallel replicas)",
}


def is_secret(name: str) -> bool:
    """Whether an option's value must never be printed (canonical name, no ``option.`` prefix)."""
    low = name.lower().replace("-", "_").replace(".", "_")
    return low in SECRET_OPTIONS or bool(_SECRET_WORDS & set(low.split("_")))


def is_secret_env(var: str) -> bool:
    """Whether an environment variable's value must never be printed (HF_TOKEN, OPTION_API_KEY, ...)."""
    name = var[len("OPTION_"):] if var.upper().startswith("OPTION_") else var
    return is_secret(name) or var.upper() in SECRET_ENV_VARS


def masked(name: str, value: Any) -> Any:
    """``value`` or ``***`` when ``name`` holds a secret; a URL's userinfo (user:password@) is masked too."""
    if is_secret(name):
        return "***"
    if isinstance(value, str) and "://" in value and "@" in value.partition("://")[2].partition("/")[0]:
        scheme, _, rest = value.partition("://")
        return f"{scheme}://***@{rest.partition('@')[2]}"
    return value
