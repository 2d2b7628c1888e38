"""validate: findings for a hand-written LMCache YAML against a host and a model."""
from __future__ import annotations

from pathlib import Path

import pytest
from plan_helpers import LLAMA8B, disk, host

from autoconfig.plan.settings import ServingSettings
from autoconfig.validate import ValidateInputError, validate_config

HOST = host(2, 400, disks=[disk("/nvme", free_gib=1000, total_gib=2000)])


def _check(tmp_path: Path, text: str, *, live: bool = False, tp: int = 2):
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return validate_config(str(path), LLAMA8B, ServingSettings(tp=tp), HOST, check_local_paths=live)


def _errors(findings):
    return [f for f in findings if f.level == "error"]


def test_good_config_has_no_errors(tmp_path: Path) -> None:
    findings = _check(tmp_path, "chunk_size: 256\nmax_local_cpu_size: 100\nlocal_disk: file:///nvme/kv/\n"
                                "max_local_disk_size: 300\nextra_config: {use_odirect: true}\n")
    assert _errors(findings) == []


def test_key_typos_get_did_you_mean(tmp_path: Path) -> None:
    findings = _check(tmp_path, "chunk_sise: 512\nmax_local_cpu_size: 10\nlocal_dsk: file:///nvme/\n")
    errors = _errors(findings)
    assert {f.key for f in errors} == {"chunk_sise", "local_dsk"}
    assert any("did you mean 'chunk_size'" in f.message for f in errors)


def test_cpu_size_that_cannot_fit_ram_times_ranks(tmp_path: Path) -> None:
    findings = _check(tmp_path, "max_local_cpu_size: 300\n")  # 2 ranks x 300 > 400 GiB
    errors = _errors(findings)
    assert [f.key for f in errors] == ["max_local_cpu_size"]
    assert "lmcache_" not in errors[0].message and "does not fit" in errors[0].message


def test_disk_size_and_cpu_size_errors_both_reported(tmp_path: Path) -> None:
    findings = _check(tmp_path, "max_local_cpu_size: 300\nlocal_disk: file:///nvme/kv/\nmax_local_disk_size: 900\n")
    assert {f.key for f in _errors(findings)} == {"max_local_cpu_size", "max_local_disk_size"}


def test_disk_path_on_unknown_filesystem(tmp_path: Path) -> None:
    findings = _check(tmp_path, "local_disk: file:///elsewhere/\nmax_local_disk_size: 10\n")
    assert any(f.key == "local_disk" and f.level == "warning" for f in findings)


def test_bad_chunk_size_is_an_error(tmp_path: Path) -> None:
    assert [f.key for f in _errors(_check(tmp_path, "chunk_size: 100\n"))] == ["chunk_size"]


def test_bad_value_type_is_an_error(tmp_path: Path) -> None:
    errors = _errors(_check(tmp_path, "max_local_cpu_size: lots\n"))
    assert len(errors) == 1 and "max_local_cpu_size" in errors[0].message


def test_local_paths_checked_on_live_host(tmp_path: Path) -> None:
    not_dir = tmp_path / "afile"
    not_dir.write_text("x")
    findings = _check(tmp_path, f"local_disk: file://{not_dir}/\nmax_local_disk_size: 1\n", live=True)
    assert any(f.key == "local_disk" and "not a directory" in f.message for f in _errors(findings))
    new_dir = tmp_path / "new" / "kv"
    findings = _check(tmp_path, f"local_disk: file://{new_dir}/\nmax_local_disk_size: 1\n", live=True)
    assert any("will be created" in f.message for f in findings)


def test_settings_error_when_tp_exceeds_gpus(tmp_path: Path) -> None:
    errors = _errors(_check(tmp_path, "chunk_size: 256\n", tp=8))
    assert [f.key for f in errors] == ["settings"]


@pytest.mark.parametrize("text", ["chunk_size: [\n", "- a\n- b\n"])
def test_unreadable_yaml_is_a_user_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValidateInputError):
        _check(tmp_path, text)


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ValidateInputError, match="no such file"):
        validate_config(str(tmp_path / "nope.yaml"), LLAMA8B, ServingSettings(), HOST)


def test_every_finding_of_a_file_comes_in_one_run(tmp_path: Path) -> None:
    """Bad values, a size vLLM cannot use, a typo and the warnings: one run, not one run per fix."""
    findings = _check(tmp_path, "chunk_size: 100\nmax_local_cpu_size: abc\nmax_local_disk_size: -1\n"
                                "local_disk: file:///nvme/kv/\ncache_polcy: LRU\nremote_url: lm://localhost:65432\n")
    assert {f.key for f in _errors(findings)} == {"max_local_cpu_size", "max_local_disk_size", "chunk_size"}
    warnings = [f for f in findings if f.level == "warning"]
    assert {f.key for f in warnings} >= {"cache_polcy", "local_disk", "remote_url"}
    assert sum("max_local_disk_size is 0" in f.message or "is not used" in f.message for f in warnings) == 1


def test_lmcache_variables_are_applied_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text("max_local_cpu_size: 300\n")  # 2 ranks x 300 > 400 GiB
    env = {"LMCACHE_MAX_LOCAL_CPU_SIZE": "20"}
    assert _errors(validate_config(str(path), LLAMA8B, ServingSettings(tp=2), HOST, check_local_paths=False,
                                   env=env)) == []
    errors = _errors(validate_config(str(path), LLAMA8B, ServingSettings(tp=2), HOST, check_local_paths=False,
                                     env={"LMCACHE_MAX_LOCAL_CPU_SIZE": "900"}))
    assert [f.message.split("=", 1)[0] for f in errors] == ["environment variable LMCACHE_MAX_LOCAL_CPU_SIZE"]


def test_a_yaml_that_is_a_directory_says_so(tmp_path: Path) -> None:
    (tmp_path / "lmcache.yaml").mkdir()
    with pytest.raises(ValidateInputError, match="is a directory, not an LMCache YAML file"):
        validate_config(str(tmp_path / "lmcache.yaml"), LLAMA8B, ServingSettings(), HOST)
