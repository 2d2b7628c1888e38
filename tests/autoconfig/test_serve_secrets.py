"""Secrets never reach argv or the printed lines; option values never become extra vLLM flags.

Also the runtime directory: used only when private to the serving user, and
``--dry-run`` writes nothing.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from autoconfig.serve.configure import configure
from autoconfig.serve.launch import prepare_launch
from lmi_cache.errors import UserError
from tests.autoconfig.test_serve import launch, make_host, model_dir
from tests.autoconfig.test_serve_cli import run_serve


def printed(result: object) -> str:
    return "\n".join(getattr(result, "summary")) + "\n" + getattr(result, "command_line")()


def test_one_api_key_goes_to_vllm_through_its_environment(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.api_key=sk-only\n")
    assert "--api-key" not in result.argv and "sk-only" not in " ".join(result.argv)
    assert result.env["VLLM_API_KEY"] == "sk-only"
    assert "sk-only" not in printed(result)
    assert "env VLLM_API_KEY=***" in printed(result)


@pytest.mark.vllm
def test_several_api_keys_travel_in_a_private_config_file_and_none_is_printed(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.api_key=sk-one,sk-two\n")
    joined = " ".join(result.argv)
    assert "sk-one" not in joined and "sk-two" not in joined
    text = printed(result)
    assert "sk-one" not in text and "sk-two" not in text
    config = Path(result.argv[result.argv.index("--config") + 1])
    assert config.parent == tmp_path / "runtime"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert '"sk-one", "sk-two"' in config.read_text()
    # vLLM's own parser reads the file back as two keys.
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert FlexibleArgumentParser().load_config_file(str(config)) == ["--api-key", "sk-one", "sk-two"]


def test_hf_token_from_an_env_option_is_masked_in_configure_messages(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "")
    result = configure(mdir, tmp_path / "rt", {"OPTION_HF_TOKEN": "hf_abcdef"}, host=make_host(1))
    assert all("hf_abcdef" not in m for m in result.messages)
    assert any("hf_token = ***" in m for m in result.messages)


@pytest.mark.parametrize(
    "line",
    [
        "option.served_model_name=x --trust-remote-code --host 203.0.113.9",
        'option.served_model_name=["x", "--trust-remote-code"]',
        "option.chat_template=--trust-remote-code",
        "option.api_key=sk-one,--host",
    ],
)
def test_a_value_that_reads_as_a_flag_is_refused(tmp_path: Path, line: str) -> None:
    with pytest.raises(UserError, match="may not start with '-'") as info:
        launch(tmp_path, line + "\n")
    assert "\n" not in str(info.value)
    assert "203.0.113.9" not in str(info.value)


def test_list_values_are_each_one_argument(tmp_path: Path) -> None:
    result = launch(tmp_path, "option.served_model_name=alpha,beta\noption.seed=-1\n")
    at = result.argv.index("--served-model-name")
    assert result.argv[at + 1:at + 3] == ["alpha", "beta"]
    assert result.argv[result.argv.index("--seed") + 1] == "-1"  # a negative number is a value, not a flag


def test_dry_run_writes_no_files(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_auto_config=true\noption.api_key=a,b\n")
    out = tmp_path / "runtime"
    result = prepare_launch(mdir, {}, host=make_host(1), output_dir=out, python="/usr/bin/python3", dry_run=True)
    assert result.mode == "auto" and "--config" in result.argv
    assert not out.exists()


def test_runtime_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory to another uid")  # CI runs as root
    planted = tmp_path / "shared" / "lmi-cache"
    planted.mkdir(parents=True)
    os.chown(planted, 65534, 65534)
    mdir = model_dir(tmp_path, "option.lmcache_auto_config=true\n")
    for dry_run in (True, False):
        with pytest.raises(UserError, match="owned by uid 65534") as info:
            prepare_launch(mdir, {}, host=make_host(1), output_dir=planted, python="/usr/bin/python3",
                           dry_run=dry_run)
        assert "\n" not in str(info.value) and "LMI_CACHE_RUNTIME_DIR" in str(info.value)
    assert list(planted.iterdir()) == [], "nothing may be written into someone else's directory"
    # As a process: one line, exit 2.
    proc = run_serve(tmp_path, "option.lmcache_auto_config=true\n", env={"LMI_CACHE_RUNTIME_DIR": str(planted)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "owned by uid 65534" in proc.stderr


def test_runtime_dir_of_ours_with_loose_mode_is_tightened(tmp_path: Path) -> None:
    loose = tmp_path / "rt"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    configure(model_dir(tmp_path, ""), loose, {}, host=make_host(1))
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_dry_run_cli_never_prints_a_secret(tmp_path: Path) -> None:
    proc = run_serve(tmp_path, "option.api_key=sk-one,sk-two\noption.hf_token=hf_zz\n")
    assert proc.returncode == 0, proc.stderr
    for secret in ("sk-one", "sk-two", "hf_zz"):
        assert secret not in proc.stdout + proc.stderr
