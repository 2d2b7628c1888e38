"""``option.model_id=s3://...`` (LMI's integration tests and guides use it): copied before vLLM starts.

Against a local moto S3 server (boto3 over HTTP, never AWS).
"""
from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.moto_server import moto_endpoint

from autoconfig.model.s3 import local_dir
from lmi_cache.errors import UserError
from tests.autoconfig.test_serve import FIXTURES, flag_value, make_host, model_dir
from autoconfig.serve.launch import prepare_launch

BUCKET = "djl-llm"
PREFIX = "llama-3-8b-instruct-hf/"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with moto_endpoint() as url:
        yield url


@pytest.fixture()
def s3(moto_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    import boto3

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_url,
                        "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    config = (FIXTURES / "llama-3.1-8b-instruct" / "config.json").read_bytes()
    client.put_object(Bucket=BUCKET, Key=PREFIX + "config.json", Body=config)
    client.put_object(Bucket=BUCKET, Key=PREFIX + "model-00001-of-00001.safetensors", Body=b"w" * 4096)
    client.put_object(Bucket=BUCKET, Key=PREFIX + "tokenizer/tokenizer.json", Body=b"{}")
    yield client
    for obj in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    client.delete_bucket(Bucket=BUCKET)


def start(tmp_path: Path, properties: str, dry_run: bool = False) -> Any:
    mdir = model_dir(tmp_path, properties, model=None)
    return prepare_launch(mdir, {}, host=make_host(4), output_dir=tmp_path / "runtime", python="python3",
                          dry_run=dry_run)


def test_s3_model_is_copied_into_the_private_runtime_dir_and_served_from_there(tmp_path: Path, s3: Any) -> None:
    uri = f"s3://{BUCKET}/{PREFIX}"
    result = start(tmp_path, f"option.model_id={uri}\noption.tensor_parallel_degree=4\n"
                             "option.lmcache_auto_config=true\n")
    local = local_dir(tmp_path / "runtime", uri)
    assert flag_value(result.argv, "--model") == str(local)
    assert (local / "tokenizer" / "tokenizer.json").read_bytes() == b"{}"
    assert (local / "model-00001-of-00001.safetensors").stat().st_size == 4096
    assert stat.S_IMODE(local.stat().st_mode) == 0o700
    assert result.mode == "auto"  # planned from the copied config.json
    plan = json.loads((tmp_path / "runtime" / "plan.json").read_text())
    assert plan["model"]["kv_bytes_per_token"] == 131072  # Llama 3.1 8B: 32 layers x 8 KV heads x 128 x 2 x 2 B


def test_a_restart_fetches_nothing_again(tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"s3://{BUCKET}/{PREFIX}"
    start(tmp_path, f"option.model_id={uri}\n")
    fetched: list[str] = []
    import boto3.s3.transfer

    real = boto3.s3.transfer.S3Transfer.download_file

    def counting(self: Any, bucket: str, key: str, filename: str, *args: Any, **kw: Any) -> Any:
        fetched.append(key)
        return real(self, bucket, key, filename, *args, **kw)

    monkeypatch.setattr(boto3.s3.transfer.S3Transfer, "download_file", counting)
    start(tmp_path, f"option.model_id={uri}\n")
    assert fetched == []


def test_dry_run_reads_only_config_json_and_writes_nothing(tmp_path: Path, s3: Any) -> None:
    uri = f"s3://{BUCKET}/{PREFIX}"
    result = start(tmp_path, f"option.model_id={uri}\noption.lmcache_auto_config=true\n", dry_run=True)
    assert result.mode == "auto"
    assert flag_value(result.argv, "--model") == str(local_dir(tmp_path / "runtime", uri))
    assert not (tmp_path / "runtime").exists()


@pytest.mark.parametrize(("uri", "expected"), [
    (f"s3://{BUCKET}/missing-model/", "no config.json under this prefix"),
    ("s3://no-such-bucket/m/", "cannot list it"),
])
def test_bad_s3_locations_fail_with_one_line(tmp_path: Path, s3: Any, uri: str, expected: str) -> None:
    with pytest.raises(UserError, match=expected) as info:
        start(tmp_path, f"option.model_id={uri}\n")
    assert "\n" not in str(info.value) and "option.model_id" in str(info.value)
