"""option.lmcache_remote_url: rendered into the planned YAML, explained by the plan, probed at start-up."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from plan_helpers import disk, host

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lmi_cache"))
from remote_fixtures import redis_server  # noqa: E402,F401

from autoconfig.serve.configure import configure  # noqa: E402
from autoconfig.lmi.properties import PropertiesError  # noqa: E402
from autoconfig.render.plan_text import format_plan  # noqa: E402
from lmi_cache.config.cache_config import load_config  # noqa: E402
from lmi_cache.devtools.redis_server import RedisServer, free_port  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
HOST = host(1, 400, disks=[disk("/nvme", free_gib=2000, total_gib=3000)])
AUTO = "option.lmcache_auto_config=true\noption.max_model_len=16384\n"


def _model_dir(tmp_path: Path, properties: str) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir()
    shutil.copy(FIXTURES / "llama-3.1-8b-instruct" / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text(properties)
    return mdir


def test_remote_url_is_rendered_explained_and_probed(tmp_path: Path, redis_server: RedisServer) -> None:
    mdir = _model_dir(tmp_path, AUTO)
    out = tmp_path / "out"
    result = configure(mdir, out, {"OPTION_LMCACHE_REMOTE_URL": redis_server.url}, host=HOST)
    config, warnings = load_config(str(out / "lmcache.yaml"), env={})
    assert config.remote_url == redis_server.url and warnings == []
    assert any(m.startswith("note: remote tier") and "answers" in m for m in result.messages), result.messages
    assert result.plan is not None
    text = format_plan(result.plan, "test")
    assert "Remote tier" in text and redis_server.url in text
    assert any("remote tier = redis store" in line and "32.0 MiB per rank" in line and "27 ms to move at 10 Gb/s" in line for line in result.plan.explanation)
    plan_json = json.loads((out / "plan.json").read_text())
    assert plan_json["tiers"]["remote"]["chunk_bytes_per_rank"] == 131072 * 256
    # vLLM never sees the option.
    assert not any("remote" in a for a in json.loads((out / "vllm_args.json").read_text()))
    # Batched remote loads keep freed memory: the server's environment says so (and only with a remote tier).
    env = json.loads((out / "env.json").read_text())
    assert env["MALLOC_MMAP_THRESHOLD_"] == "67108864" and env["MALLOC_TRIM_THRESHOLD_"] == "268435456"
    (tmp_path / "plain").mkdir()
    plain = configure(_model_dir(tmp_path / "plain", AUTO), tmp_path / "plain-out", {}, host=HOST)
    assert plain.plan is not None and "MALLOC_MMAP_THRESHOLD_" not in plain.plan.env


def test_a_store_that_does_not_answer_warns_and_the_start_goes_on(tmp_path: Path) -> None:
    mdir = _model_dir(tmp_path, AUTO + f"option.lmcache_remote_url=redis://u:pw-secret@127.0.0.1:{free_port()}\n")
    result = configure(mdir, tmp_path / "out", {}, host=HOST)
    assert result.mode == "auto" and (tmp_path / "out" / "lmcache.yaml").is_file()
    warned = [m for m in result.messages if m.startswith("warning: remote tier")]
    assert len(warned) == 1 and "did not answer" in warned[0] and "starts anyway" in warned[0]
    assert not any("pw-secret" in m for m in result.messages)  # the option summary masks the password too
    assert "pw-secret" not in format_plan(result.plan, "test") if result.plan is not None else False


def test_without_the_option_the_plan_says_off(tmp_path: Path) -> None:
    result = configure(_model_dir(tmp_path, AUTO), tmp_path / "out", {}, host=HOST)
    assert result.plan is not None and "remote_url" not in result.plan.lmcache_config
    assert "off (option.lmcache_remote_url)" in format_plan(result.plan, "test")
    assert not any("remote tier" in m for m in result.messages)


@pytest.mark.parametrize("url, needle", [("ftp://u:pw-secret@h:1", "unsupported scheme"),
                                         ("redis://u:pw-secret@:6379", "has no host"),
                                         ("s3://", "needs a bucket")])
def test_a_bad_remote_url_is_one_line_without_the_password(tmp_path: Path, url: str, needle: str) -> None:
    mdir = _model_dir(tmp_path, AUTO + f"option.lmcache_remote_url={url}\n")
    with pytest.raises(PropertiesError) as info:
        configure(mdir, tmp_path / "out", {}, host=HOST)
    message = str(info.value)
    assert "option.lmcache_remote_url" in message and needle in message
    assert "pw-secret" not in message and "\n" not in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("url", ["redis://cache", "valkey://cache", "rediss://u:pw@cache:6380/2?cluster=true",
                                 "unix:///run/redis.sock", "s3://bucket/kv"])
def test_a_url_the_option_accepts_is_one_the_engine_loads(tmp_path: Path, url: str) -> None:
    # One parser: auto-configuration never writes a remote_url the engine then refuses when vLLM starts.
    mdir = _model_dir(tmp_path, AUTO + f"option.lmcache_remote_url={url}\n")
    configure(mdir, tmp_path / "out", {}, host=HOST, check_output=False)
    config, _ = load_config(str(tmp_path / "out" / "lmcache.yaml"), env={})
    assert config.remote_url == url
