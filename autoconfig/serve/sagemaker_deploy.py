"""Deploy the lmi-cache container to a SageMaker real-time endpoint (boto3).

Run by ``lmi-cache sagemaker deploy`` on a developer's machine, not in the
container. The three requests (model, endpoint config, endpoint) are built by
a pure function so ``--dry-run`` and tests see exactly what would be sent.
Settings travel the LMI way: ``option.<name>`` becomes env ``OPTION_<NAME>``,
which the container's ``lmi-cache serve`` resolves like serving.properties.
``--env KEY=VALUE`` adds other environment variables (``HF_TOKEN``, LMI's
simplified ``TENSOR_PARALLEL_DEGREE``...). Checked before any request: the
instance type against the catalog (autoconfig/data/sagemaker_instances.json),
the parallel degrees against its GPUs, the timeouts against SageMaker's
3600 s limit. ``printable`` masks secrets for ``--dry-run`` and logs.
boto3 is imported lazily (the ``sagemaker`` extra).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from autoconfig.lmi.names import is_secret_env
from autoconfig.lmi.to_vllm import map_lmi_options
from lmi_cache.errors import UserError


class DeployError(UserError):
    """Bad deploy arguments, or a SageMaker API call refused them."""


# SageMaker resource names: alphanumerics and hyphens, at most 63 characters.
_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_ROLE_RE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/\S+$")
_OPTION_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Large models download and load for many minutes; SageMaker's defaults are shorter.
DEFAULT_STARTUP_TIMEOUT_S = 1800
# SageMaker's limit for ContainerStartupHealthCheckTimeoutInSeconds and
# ModelDataDownloadTimeoutInSeconds (ProductionVariant API reference: 60-3600).
MAX_TIMEOUT_S = 3600
MIN_TIMEOUT_S = 60


@dataclass(frozen=True)
class DeploySpec:
    """What to deploy; every field maps to one CLI flag of ``sagemaker deploy``."""

    name: str  # model, endpoint config and endpoint share it
    image_uri: str
    instance_type: str  # e.g. ml.g6e.12xlarge
    role_arn: str
    model_data: str | None = None  # s3://bucket/prefix/ (uncompressed) or s3://.../model.tar.gz
    options: Mapping[str, str] = field(default_factory=dict)  # LMI option names, no "option." prefix
    instance_count: int = 1
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    env: Mapping[str, str] = field(default_factory=dict)  # other environment variables (--env)


def parse_option_pairs(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["tensor_parallel_degree=4", "option.dtype=bf16"]`` -> option names to values."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if key.startswith("option."):
            key = key[len("option."):]
        if not sep or not _OPTION_NAME_RE.match(key):
            # The value is not echoed: it may be a token.
            raise DeployError(f"--option {key[:40]!r}: expected KEY=VALUE with KEY letters, digits and '_', "
                              "e.g. --option tensor_parallel_degree=4")
        options[key] = value.strip()
    return options


def parse_env_pairs(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["HF_TOKEN=hf_...", "TENSOR_PARALLEL_DEGREE=4"]`` -> environment variables for the container."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not _OPTION_NAME_RE.match(key):
            raise DeployError(f"--env {key[:40]!r}: expected NAME=VALUE with NAME letters, digits and '_', "
                              "e.g. --env HF_TOKEN=hf_...")
        env[key] = value
    return env


def printable(requests: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the requests with secret environment values replaced by ``***`` (for --dry-run)."""
    out = {call: dict(body) for call, body in requests.items()}
    model = dict(out["create_model"])
    container = dict(model["PrimaryContainer"])
    container["Environment"] = {k: "***" if is_secret_env(k) else v for k, v in container["Environment"].items()}
    model["PrimaryContainer"] = container
    out["create_model"] = model
    return out


def container_env(options: Mapping[str, str]) -> dict[str, str]:
    """OPTION_* environment for the container; turns auto-config on unless the user chose a YAML."""
    env = {f"OPTION_{k.upper()}": v for k, v in sorted(options.items())}
    if "lmcache_config_file" not in options and "lmcache_auto_config" not in options:
        env["OPTION_LMCACHE_AUTO_CONFIG"] = "true"
    return env


def build_requests(spec: DeploySpec) -> dict[str, dict[str, Any]]:
    """The keyword arguments of create_model, create_endpoint_config and create_endpoint."""
    _validate(spec)
    container: dict[str, Any] = {"Image": spec.image_uri,
                                 "Environment": {**container_env(spec.options), **spec.env}}
    if spec.model_data is not None:
        if spec.model_data.endswith(".tar.gz"):
            container["ModelDataUrl"] = spec.model_data
        else:
            # LMI's recommended form: an uncompressed S3 prefix copied to /opt/ml/model.
            container["ModelDataSource"] = {
                "S3DataSource": {
                    "S3Uri": spec.model_data.rstrip("/") + "/",
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                }
            }
    variant = {
        "VariantName": "AllTraffic",
        "ModelName": spec.name,
        "InstanceType": spec.instance_type,
        "InitialInstanceCount": spec.instance_count,
        "ContainerStartupHealthCheckTimeoutInSeconds": spec.startup_timeout_s,
        "ModelDataDownloadTimeoutInSeconds": spec.startup_timeout_s,
    }
    return {
        "create_model": {
            "ModelName": spec.name,
            "ExecutionRoleArn": spec.role_arn,
            "PrimaryContainer": container,
        },
        "create_endpoint_config": {"EndpointConfigName": spec.name, "ProductionVariants": [variant]},
        "create_endpoint": {"EndpointName": spec.name, "EndpointConfigName": spec.name},
    }


def deploy(
    requests: Mapping[str, Mapping[str, Any]],
    region: str | None = None,
    endpoint_url: str | None = None,
    client: Any = None,
) -> dict[str, str]:
    """Send the three requests in order; return the ARNs SageMaker answered.

    Does not wait for the endpoint to be InService (that takes minutes): poll
    with ``aws sagemaker wait endpoint-in-service``.
    """
    if client is None:
        client = make_client(region, endpoint_url)
    arns: dict[str, str] = {}
    created: list[tuple[str, dict[str, str]]] = []
    for call, arn_key, delete_call, name_key in _CALLS:
        try:
            response = getattr(client, call)(**requests[call])
        except Exception as err:  # botocore ClientError / endpoint errors: one line for the user
            undone = _roll_back(client, created)
            raise DeployError(f"sagemaker {call} failed: {_one_line(err)}{undone}") from None
        created.append((delete_call, {name_key: str(requests[call][name_key])}))
        arns[arn_key] = str(response.get(arn_key, ""))
    return arns


# (create call, ARN in its answer, the call that undoes it, the name parameter both take)
_CALLS = (
    ("create_model", "ModelArn", "delete_model", "ModelName"),
    ("create_endpoint_config", "EndpointConfigArn", "delete_endpoint_config", "EndpointConfigName"),
    ("create_endpoint", "EndpointArn", "delete_endpoint", "EndpointName"),
)


def _roll_back(client: Any, created: list[tuple[str, dict[str, str]]]) -> str:
    """Delete what this run created (newest first) so a retry starts clean; say what happened."""
    if not created:
        return ""
    failed = []
    for delete_call, kwargs in reversed(created):
        try:
            getattr(client, delete_call)(**kwargs)
        except Exception:  # best effort: report, never mask the original error
            failed.append(f"{delete_call}({next(iter(kwargs.values()))})")
    if failed:
        return f" (could not undo: {', '.join(failed)}; delete by hand)"
    return f" (rolled back: {', '.join(c.replace('delete_', '') for c, _ in created)})"


def make_client(region: str | None, endpoint_url: str | None) -> Any:
    try:
        import boto3
    except ImportError:
        raise DeployError("boto3 is not installed: pip install 'lmi-cache[sagemaker]'") from None
    session = boto3.session.Session(region_name=region)
    if session.region_name is None:
        raise DeployError("no AWS region: pass --region or set AWS_REGION / AWS_DEFAULT_REGION")
    return session.client("sagemaker", endpoint_url=endpoint_url)


def _validate(spec: DeploySpec) -> None:
    if not _NAME_RE.match(spec.name):
        raise DeployError(f"--name {spec.name!r}: use 1-63 letters, digits and hyphens, starting with a letter or digit")
    if not spec.image_uri.strip():
        raise DeployError("--image: give the container image URI (e.g. <account>.dkr.ecr.<region>.amazonaws.com/lmi-cache:gpu)")
    if not spec.instance_type.startswith("ml."):
        raise DeployError(f"--instance-type {spec.instance_type!r}: SageMaker instance types start with 'ml.', e.g. ml.g6e.12xlarge")
    if not _ROLE_RE.match(spec.role_arn):
        raise DeployError(f"--role {spec.role_arn!r}: expected an IAM role ARN, arn:aws:iam::<12 digits>:role/<name>")
    if spec.model_data is not None and not spec.model_data.startswith("s3://"):
        raise DeployError(f"--model-data {spec.model_data!r}: expected an s3:// URI (a prefix or a model.tar.gz)")
    if spec.model_data is None and "model_id" not in spec.options:
        raise DeployError("no model: pass --model-data s3://... or --option model_id=<hub id>")
    if spec.instance_count < 1:
        raise DeployError("--instance-count must be at least 1")
    if not MIN_TIMEOUT_S <= spec.startup_timeout_s <= MAX_TIMEOUT_S:
        raise DeployError(f"--startup-timeout {spec.startup_timeout_s}: SageMaker accepts {MIN_TIMEOUT_S}-"
                          f"{MAX_TIMEOUT_S} seconds")
    for key in spec.env:
        if key.startswith("OPTION_") and key[len("OPTION_"):].lower() in spec.options:
            raise DeployError(f"--env {key} and --option {key[len('OPTION_'):].lower()} both set: keep one")
    _check_instance(spec)
    if "lmcache_config_file" in spec.options and spec.options.get("lmcache_auto_config", "").lower() == "true":
        raise DeployError("--option lmcache_auto_config=true and --option lmcache_config_file both set: keep one")
    # Same check as the container's start-up, so a typo fails here and not after an endpoint is billed.
    map_lmi_options(spec.options, {k: f"--option {k}" for k in spec.options})


def _check_instance(spec: DeploySpec) -> None:
    """The instance type must be in the catalog and hold tp x pp x dp GPUs."""
    from autoconfig.probe.catalog import UnknownInstanceError, get_instance

    try:
        inst = get_instance(spec.instance_type)
    except UnknownInstanceError as err:
        raise DeployError(f"--instance-type: {err} (the catalog lists the GPU instance types lmi-cache can plan "
                          "for: lmi-cache plan --instance-type)") from None
    degrees = {}
    for name, env_names in (("tensor_parallel_degree", ("TENSOR_PARALLEL_DEGREE", "SM_NUM_GPUS")),
                            ("pipeline_parallel_degree", ()), ("data_parallel_degree", ())):
        raw, where = _setting(spec, name, env_names)
        if raw is None or (name == "tensor_parallel_degree" and raw.strip().lower() == "max"):
            continue
        try:
            degrees[name] = (int(raw), where)
        except ValueError:
            raise DeployError(f"{where}={raw!r}: expected a positive integer") from None
    need = 1
    for value, _ in degrees.values():
        need *= max(1, value)
    if need > inst.gpu_count:
        named = " x ".join(f"{where}={value}" for value, where in degrees.values())
        raise DeployError(f"{named} needs {need} GPUs but {inst.name} has {inst.gpu_count}: "
                          "lower the degree or choose a larger instance type")


def _setting(spec: DeploySpec, name: str, env_names: tuple[str, ...]) -> tuple[str | None, str]:
    """Where the container would read ``name`` from: --option, --env OPTION_*, then LMI's simplified variables."""
    if name in spec.options:
        return spec.options[name], f"--option {name}"
    for var in (f"OPTION_{name.upper()}", *env_names):
        if spec.env.get(var, "").strip():
            return spec.env[var], f"--env {var}"
    return None, name


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split()) or type(err).__name__
