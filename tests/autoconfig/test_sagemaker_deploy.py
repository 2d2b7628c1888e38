"""``lmi-cache sagemaker deploy`` against a local moto server (boto3 over HTTP, never AWS)."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from tests.moto_server import moto_endpoint
from click.testing import CliRunner

from autoconfig.cli_serve import deploy as deploy_command
from autoconfig.serve.sagemaker_deploy import (
    DeployError,
    DeploySpec,
    build_requests,
    container_env,
    deploy,
    parse_option_pairs,
)
from lmi_cache.errors import UserError

ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/lmi-cache:gpu"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with moto_endpoint() as url:
        yield url


@pytest.fixture(autouse=True)
def fake_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # Fake credentials and no config files: nothing can reach a real account.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))


def _spec(**kw: Any) -> DeploySpec:
    base: dict[str, Any] = dict(name="llama-70b-cache", image_uri=IMAGE, instance_type="ml.g6e.12xlarge",
                                role_arn=ROLE, model_data="s3://bucket/llama-3.3-70b/",
                                options={"tensor_parallel_degree": "4", "max_rolling_batch_size": "64"})
    base.update(kw)
    return DeploySpec(**base)


def test_requests_carry_image_model_data_instance_and_option_env() -> None:
    req = build_requests(_spec())
    container = req["create_model"]["PrimaryContainer"]
    assert container["Image"] == IMAGE
    assert container["ModelDataSource"]["S3DataSource"]["S3Uri"] == "s3://bucket/llama-3.3-70b/"
    assert container["ModelDataSource"]["S3DataSource"]["CompressionType"] == "None"
    assert container["Environment"] == {
        "OPTION_TENSOR_PARALLEL_DEGREE": "4",
        "OPTION_MAX_ROLLING_BATCH_SIZE": "64",
        "OPTION_LMCACHE_AUTO_CONFIG": "true",
    }
    variant = req["create_endpoint_config"]["ProductionVariants"][0]
    assert variant["InstanceType"] == "ml.g6e.12xlarge"
    assert variant["ModelName"] == "llama-70b-cache"
    assert req["create_endpoint"] == {"EndpointName": "llama-70b-cache", "EndpointConfigName": "llama-70b-cache"}


def test_tarball_model_data_uses_model_data_url() -> None:
    container = build_requests(_spec(model_data="s3://b/model.tar.gz"))["create_model"]["PrimaryContainer"]
    assert container["ModelDataUrl"] == "s3://b/model.tar.gz"
    assert "ModelDataSource" not in container


def test_user_yaml_turns_auto_config_off_and_explicit_false_is_kept() -> None:
    assert "OPTION_LMCACHE_AUTO_CONFIG" not in container_env({"lmcache_config_file": "lmcache.yaml"})
    assert container_env({"lmcache_auto_config": "false"})["OPTION_LMCACHE_AUTO_CONFIG"] == "false"


def test_option_pairs_accept_the_option_prefix_and_reject_garbage() -> None:
    assert parse_option_pairs(["option.dtype=bfloat16", "max_model_len = 8192"]) == {
        "dtype": "bfloat16", "max_model_len": "8192"}
    with pytest.raises(DeployError, match="KEY=VALUE"):
        parse_option_pairs(["dtype"])


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"name": "bad_name!"}, "--name"),
        ({"instance_type": "g6e.12xlarge"}, "--instance-type"),
        ({"role_arn": "SageMakerRole"}, "--role"),
        ({"model_data": "/local/path"}, "--model-data"),
        ({"model_data": None}, "no model"),
        ({"options": {"tensor_paralel_degree": "4"}}, "did you mean option.tensor_parallel_degree"),
        ({"options": {"lmcache_auto_config": "true", "lmcache_config_file": "x.yaml"}}, "keep one"),
        ({"instance_type": "ml.g6e.13xlarge"}, "did you mean .*ml.g6e.12xlarge"),
        ({"instance_type": "ml.c5.xlarge"}, "--instance-type: unknown SageMaker instance type"),
        ({"options": {"tensor_parallel_degree": "8"}}, "--option tensor_parallel_degree=8 needs 8 GPUs but "
                                                      "ml.g6e.12xlarge has 4"),
        ({"options": {}, "env": {"TENSOR_PARALLEL_DEGREE": "8"}}, "--env TENSOR_PARALLEL_DEGREE=8 needs 8 GPUs"),
        ({"options": {"tensor_parallel_degree": "2", "data_parallel_degree": "4"}}, "needs 8 GPUs"),
        ({"startup_timeout_s": 3601}, "60-3600 seconds"),
        ({"startup_timeout_s": 59}, "60-3600 seconds"),
        ({"env": {"OPTION_DTYPE": "fp16"}, "options": {"dtype": "bf16"}}, "keep one"),
    ],
)
def test_bad_arguments_fail_before_any_request(change: dict[str, Any], expected: str) -> None:
    with pytest.raises(UserError, match=expected) as info:
        build_requests(_spec(**change))
    assert "\n" not in str(info.value)


# moto 5 validates endpoint-config instance types against an old list (g4dn, p3: none of them GPU types
# lmi-cache's catalog plans for): the tests that must succeed let moto accept this catalog type too.
MOTO_INSTANCE = "ml.g5.12xlarge"


@pytest.fixture()
def moto_accepts_catalog_types(monkeypatch: pytest.MonkeyPatch) -> None:
    from moto.sagemaker.models import FakeEndpointConfig

    monkeypatch.setattr(FakeEndpointConfig, "validate_instance_type", lambda self, instance_type: None)


@pytest.mark.usefixtures("moto_accepts_catalog_types")
def test_deploy_creates_model_config_and_endpoint_on_moto(moto_url: str) -> None:
    import boto3

    arns = deploy(build_requests(_spec(instance_type=MOTO_INSTANCE)), region="us-west-2", endpoint_url=moto_url)
    assert arns["EndpointArn"].endswith(":endpoint/llama-70b-cache")
    client = boto3.client("sagemaker", region_name="us-west-2", endpoint_url=moto_url)
    model = client.describe_model(ModelName="llama-70b-cache")
    assert model["ExecutionRoleArn"] == ROLE
    assert model["PrimaryContainer"]["Environment"]["OPTION_LMCACHE_AUTO_CONFIG"] == "true"
    assert model["PrimaryContainer"]["Image"] == IMAGE
    config = client.describe_endpoint_config(EndpointConfigName="llama-70b-cache")
    assert config["ProductionVariants"][0]["InstanceType"] == MOTO_INSTANCE
    endpoint = client.describe_endpoint(EndpointName="llama-70b-cache")
    assert endpoint["EndpointConfigName"] == "llama-70b-cache"


def test_refused_request_is_one_line_and_rolls_back_on_moto(moto_url: str) -> None:
    import boto3

    # A type the catalog knows but moto (like an account without quota) refuses.
    requests = build_requests(_spec(name="refused", instance_type="ml.g6e.12xlarge"))
    with pytest.raises(DeployError, match="sagemaker create_endpoint_config failed") as info:
        deploy(requests, region="us-west-2", endpoint_url=moto_url)
    assert "\n" not in str(info.value)
    assert "rolled back: model" in str(info.value)
    client = boto3.client("sagemaker", region_name="us-west-2", endpoint_url=moto_url)
    assert "refused" not in [m["ModelName"] for m in client.list_models()["Models"]]


def test_cli_dry_run_prints_requests_and_sends_nothing(moto_url: str) -> None:
    import boto3

    args = ["--name", "dry", "--image", IMAGE, "--model-data", "s3://b/m/", "--instance-type", "ml.g6e.12xlarge",
            "--role", ROLE, "--option", "tensor_parallel_degree=4", "--region", "us-west-2",
            "--endpoint-url", moto_url, "--dry-run"]
    result = CliRunner().invoke(deploy_command, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    assert printed["create_model"]["PrimaryContainer"]["Environment"]["OPTION_TENSOR_PARALLEL_DEGREE"] == "4"
    client = boto3.client("sagemaker", region_name="us-west-2", endpoint_url=moto_url)
    names = [m["ModelName"] for m in client.list_models()["Models"]]
    assert "dry" not in names


@pytest.mark.usefixtures("moto_accepts_catalog_types")
def test_cli_deploy_prints_the_arns(moto_url: str) -> None:
    args = ["--name", "via-cli", "--image", IMAGE, "--model-data", "s3://b/m/", "--instance-type", MOTO_INSTANCE,
            "--role", ROLE, "--region", "us-west-2", "--endpoint-url", moto_url]
    result = CliRunner().invoke(deploy_command, args)
    assert result.exit_code == 0, result.output
    assert "EndpointArn: arn:aws:sagemaker:us-west-2:" in result.output


class _FailingClient:
    """Records calls; create_endpoint_config fails like a refused request."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def call(**kwargs: Any) -> dict[str, str]:
            self.calls.append(name)
            if name == "create_endpoint_config":
                raise RuntimeError("ValidationException: instance type not allowed\nsecond line")
            return {"ModelArn": "arn:model"}
        return call


def test_failure_rolls_back_what_was_created() -> None:
    client = _FailingClient()
    with pytest.raises(DeployError) as info:
        deploy(build_requests(_spec()), client=client)
    assert client.calls == ["create_model", "create_endpoint_config", "delete_model"]
    assert "rolled back: model" in str(info.value)
    assert "\n" not in str(info.value)


def test_env_pairs_reach_the_container_and_secrets_are_never_printed() -> None:
    args = ["--name", "sec", "--image", IMAGE, "--model-data", "s3://b/m/", "--instance-type", "ml.g6e.12xlarge",
            "--role", ROLE, "--option", "hf_token=hf_opt_secret", "--option", "api_key=sk-one,sk-two",
            "--env", "HF_TOKEN=hf_env_secret", "--env", "TENSOR_PARALLEL_DEGREE=4", "--dry-run"]
    result = CliRunner().invoke(deploy_command, args)
    assert result.exit_code == 0, result.output
    for secret in ("hf_opt_secret", "hf_env_secret", "sk-one", "sk-two"):
        assert secret not in result.output
    env = json.loads(result.output)["create_model"]["PrimaryContainer"]["Environment"]
    assert env["HF_TOKEN"] == "***" and env["OPTION_HF_TOKEN"] == "***" and env["OPTION_API_KEY"] == "***"
    assert env["TENSOR_PARALLEL_DEGREE"] == "4"
    # The request itself carries the real values.
    spec = _spec(options={"hf_token": "hf_opt_secret"}, env={"HF_TOKEN": "hf_env_secret"})
    sent = build_requests(spec)["create_model"]["PrimaryContainer"]["Environment"]
    assert sent["HF_TOKEN"] == "hf_env_secret" and sent["OPTION_HF_TOKEN"] == "hf_opt_secret"


def test_bad_pairs_do_not_echo_their_value() -> None:
    from autoconfig.serve.sagemaker_deploy import parse_env_pairs

    with pytest.raises(DeployError) as info:
        parse_option_pairs(["hf token=hf_leak"])
    assert "hf_leak" not in str(info.value)
    with pytest.raises(DeployError) as info:
        parse_env_pairs(["HF-TOKEN=hf_leak"])
    assert "hf_leak" not in str(info.value)
