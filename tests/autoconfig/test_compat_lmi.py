"""Real LMI serving.properties files (tests/fixtures/compat/lmi/, sources in its SOURCES.md) start as their authors expect.

Each case directory holds the file as LMI's integration tests write it (plus
the LMCache YAML they copy beside it) and ``expected.json``: served (mode,
connector, vLLM arguments, environment, the notes a user sees) or refused
(the message). Each is started with ``lmi-cache serve``'s own checks
(``prepare_launch``, dry run) on the host LMI's benchmarks use
(ml.p4de.24xlarge: 8 x A100 80 GB) with the environment the case's
``run_env`` names (LMI's guide sets ``LMCACHE_CONFIG_FILE``); Hub models the cache must size are found
in a local Hugging Face cache made from our config.json fixtures, and the
``s3://djl-llm/...`` models LMI's tests use in a local moto S3 server (a dry
run reads only their config.json).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.moto_server import moto_endpoint

from autoconfig.probe.catalog import host_snapshot_for
from autoconfig.probe.snapshot import HostSnapshot
from autoconfig.serve.launch import ServeLaunch, prepare_launch
from lmi_cache.errors import UserError

ROOT = Path(__file__).resolve().parents[1] / "fixtures"
CASES = sorted(p.name for p in (ROOT / "compat" / "lmi").iterdir() if p.is_dir())
# Hub ids of the cache-enabled cases -> our config.json fixture of the same architecture.
HUB_CONFIGS = {"Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen2.5-7B": "qwen2.5-7b-instruct",
               "Qwen/Qwen2.5-72B": "qwen2.5-72b-instruct"}
# S3 model prefixes of the cases -> our config.json fixture of the same architecture (Llama 3 8B = 3.1 8B's KV).
S3_CONFIGS = {("djl-llm", "llama-3-8b-instruct-hf/"): "llama-3.1-8b-instruct"}


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    import boto3

    with moto_endpoint() as url:
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
        for (bucket, prefix), fixture in S3_CONFIGS.items():
            client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key=prefix + "config.json",
                              Body=(ROOT / "hf_configs" / fixture / "config.json").read_bytes())
        yield url


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf")
    for model_id, fixture in HUB_CONFIGS.items():
        repo = home / "hub" / ("models--" + model_id.replace("/", "--"))
        (repo / "snapshots" / "r0").mkdir(parents=True)
        shutil.copy(ROOT / "hf_configs" / fixture / "config.json", repo / "snapshots" / "r0" / "config.json")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("r0")
    return home


def lmi_host() -> HostSnapshot:
    """ml.p4de.24xlarge as the catalog sees it, plus /opt/ml: SageMaker mounts the ML storage volume
    (the NVMe instance store on this type) there, where LMI's tests put a disk tier (/opt/ml/model/cache/)."""
    host = host_snapshot_for("ml.p4de.24xlarge")
    store = next(d for d in host.disks if d.nvme)
    return replace(host, disks=[*host.disks, replace(store, mount="/opt/ml")])


def start(case: str, hf_home: Path, tmp_path: Path, run_env: dict[str, str]) -> ServeLaunch:
    case_dir = ROOT / "compat" / "lmi" / case
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
           **{k: v.replace("{dir}", str(case_dir)) for k, v in run_env.items()}}
    return prepare_launch(ROOT / "compat" / "lmi" / case, env, host=lmi_host(),
                          output_dir=tmp_path / "runtime", python="python3", dry_run=True)


def test_the_suite_is_broad() -> None:
    assert len(CASES) >= 15
    sources = (ROOT / "compat" / "lmi" / "SOURCES.md").read_text()
    assert all(f"`{case}/`" in sources for case in CASES), "every case needs its source in SOURCES.md"


@pytest.mark.parametrize("case", CASES)
def test_real_lmi_file_behaves_as_its_authors_expect(case: str, hf_home: Path, s3_server: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "LMCACHE_CONFIG_FILE", "CUDA_VISIBLE_DEVICES",
                "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": str(tmp_path / "none"),
                       "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(var, value)
    case_dir = ROOT / "compat" / "lmi" / case
    expected: dict[str, Any] = json.loads((case_dir / "expected.json").read_text())
    if expected["outcome"] == "refused":
        with pytest.raises(UserError) as info:
            start(case, hf_home, tmp_path, expected.get("run_env", {}))
        assert expected["message"] in str(info.value) and "\n" not in str(info.value)
        return
    result = start(case, hf_home, tmp_path, expected.get("run_env", {}))
    assert result.mode == expected["mode"]
    argv = result.argv
    if expected["connector"] is None:
        assert "--kv-transfer-config" not in argv
    else:
        assert argv.count("--kv-transfer-config") == 1
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector"] == expected["connector"]
    for flag, value in expected["args"].items():
        assert argv.count(flag) == 1, f"{flag} in {argv}"
        if value is not True:
            assert argv[argv.index(flag) + 1] == value, f"{flag} in {argv}"
    if expected.get("model_from_s3"):  # copied from S3 into the runtime directory before vLLM starts
        assert argv[argv.index("--model") + 1].startswith(str(tmp_path / "runtime" / "s3-models") + "/")
    for flag in expected["absent"]:
        assert flag not in argv
    for var, value in expected["env"].items():
        assert result.env_set[var] == value.replace("{dir}", str(case_dir))
    notes = [line for line in result.summary if line.startswith("note:")]
    for wanted in expected["notes"]:
        assert any(wanted in line for line in notes), f"no note with {wanted!r} in {notes}"
    assert not [line for line in result.summary if "ERROR" in line]
    assert not (tmp_path / "runtime").exists()
