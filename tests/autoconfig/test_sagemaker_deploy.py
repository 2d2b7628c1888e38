"""``lmi-cache sagemaker deploy`` against a local moto server (boto3 over HTTP, never AWS)."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from click.testing import CliRunner

from autoconfig.cli_serve import deploy as deploy_command
from autoconfig.sagemaker_deploy import (
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
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


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
    ],
)
def test_bad_arguments_fail_before_any_request(change: dict[str, Any], expected: str) -> None:
    with pytest.raises(UserError, match=expected) as info:
        build_requests(_spec(**change))
    assert "\n" not in str(info.value)


# moto 5 validates instance types against an older list than SageMaker's (no g6e): use one it knows.
MOTO_INSTANCE = "ml.g4dn.12xlarge"


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

    requests = build_requests(_spec(name="refused", instance_type="ml.not-a-type.xlarge"))
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
