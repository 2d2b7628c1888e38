"""A newcomer's habits get one clear answer: vLLM's --host/--port, LMI's container paths, files that are not
files, duplicate keys, settings that a file overrides, and a Hugging Face id without a network.

Each test runs the ``lmi-cache`` command the user would type (through click's runner) and checks the one
line it prints; no vLLM is imported.
"""
from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from click.testing import CliRunner, Result

from autoconfig.cli import main

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "fixtures" / "hf_configs" / "llama-3.1-8b-instruct"
SNAPSHOT = REPO / "tests" / "fixtures" / "hosts" / "a10g_container_memlock.json"
SMALL = ["--instance-type", "ml.g5.2xlarge"]


def model_dir(tmp_path: Path, properties: str = "option.max_model_len=8192\n") -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text(properties)
    return mdir


def run(args: list[str], tmp_path: Path, **env: str) -> Result:
    return CliRunner().invoke(main, args, env={"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "runtime"), **env})


def error_line(result: Result) -> str:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.startswith("lmi-cache: error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0][len("lmi-cache: error: "):]


def exec_argv(result: Result) -> list[str]:
    assert result.exit_code == 0, result.output
    return shlex.split(next(ln for ln in result.stdout.splitlines() if ln.startswith("exec: "))[6:])


def test_serve_passes_host_and_port_to_vllm(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path)
    argv = exec_argv(run(["serve", "--dry-run", "--model-dir", str(mdir), *SMALL, "--host", "127.0.0.1",
                          "--port", "9001"], tmp_path))
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "9001"


def test_a_snapshot_is_given_with_host_snapshot_and_the_old_spelling_says_so(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path)
    served = run(["serve", "--dry-run", "--model-dir", str(mdir), "--host-snapshot", str(SNAPSHOT)], tmp_path)
    assert served.exit_code == 0, served.output
    old = run(["serve", "--dry-run", "--model-dir", str(mdir), "--host", str(SNAPSHOT)], tmp_path)
    assert f"give a host snapshot with --host-snapshot {SNAPSHOT}" in error_line(old)
    planned = run(["plan", "--model-dir", str(mdir), "--host", str(SNAPSHOT)], tmp_path)
    assert planned.exit_code == 0, planned.output
    assert f"--host FILE is deprecated (serve passes --host to vLLM); use --host-snapshot {SNAPSHOT}" in planned.stderr
    assert planned.stdout == run(["plan", "--model-dir", str(mdir), "--host-snapshot", str(SNAPSHOT)],
                                 tmp_path).stdout


def test_a_serving_properties_that_is_not_a_file_is_an_error(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path)
    props = mdir / "serving.properties"
    props.unlink()
    props.mkdir()
    args = ["serve", "--dry-run", "--model-dir", str(mdir), *SMALL]
    assert error_line(run(args, tmp_path)).startswith(f"{props}: is a directory, not a properties file")
    props.rmdir()
    props.symlink_to(props)  # a loop
    assert error_line(run(args, tmp_path)).startswith(f"{props}: a symbolic link that leads to no file")
    assert error_line(run(["plan", "--model-dir", str(mdir), *SMALL], tmp_path)).startswith(f"{props}: a symbolic")


def test_a_key_written_twice_in_serving_properties_names_both_lines(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=4096\noption.lmcache_auto_config=true\noption.max_model_len=8192\n")
    result = run(["serve", "--dry-run", "--model-dir", str(mdir), *SMALL], tmp_path)
    assert result.exit_code == 0, result.output
    assert (f"note: {mdir / 'serving.properties'}: line 3: option.max_model_len is also set on line 1; line 3's value "
            "is used") in result.stdout
    assert "max_model_len=8192" in result.stdout


def test_a_disk_directory_with_a_zero_disk_size_is_said(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=8192\noption.lmcache_auto_config=true\n"
                               "option.lmcache_local_disk=/tmp/kv\noption.lmcache_max_local_disk_size=0\n")
    result = run(["serve", "--dry-run", "--model-dir", str(mdir), *SMALL], tmp_path)
    assert result.exit_code == 0, result.output
    props = mdir / "serving.properties"
    assert (f"warning: {props}:3: option.lmcache_local_disk=/tmp/kv is not used: {props}:4: "
            "option.lmcache_max_local_disk_size=0 turns the disk tier off") in result.stdout


def test_an_lmi_variable_the_file_overrides_is_noted(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=8192\noption.tensor_parallel_degree=1\n")
    result = run(["serve", "--dry-run", "--model-dir", str(mdir), *SMALL], tmp_path, TENSOR_PARALLEL_DEGREE="4")
    assert result.exit_code == 0, result.output
    assert (f"note: {mdir / 'serving.properties'}:2: option.tensor_parallel_degree overrides environment variable "
            "TENSOR_PARALLEL_DEGREE") in result.stdout


def test_a_bad_option_value_names_the_file_and_line(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "# settings\noption.max_model_len=8192\noption.gpu_memory_utilization=lots\n")
    line = error_line(run(["plan", "--model-dir", str(mdir), *SMALL], tmp_path))
    assert line.startswith(f"{mdir / 'serving.properties'}:3: option.gpu_memory_utilization='lots'"), line


def test_the_containers_model_path_plans_from_the_model_directory_here(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.model_id=/opt/ml/model\noption.max_model_len=8192\n"
                               "option.lmcache_auto_config=true\n")
    props = mdir / "serving.properties"
    note = (f"{props}:1: option.model_id=/opt/ml/model does not exist here; the model is {mdir}, which holds "
            "config.json")
    for args in (["plan"], ["serve", "--dry-run"]):
        result = run([*args, "--model-dir", str(mdir), *SMALL], tmp_path)
        assert result.exit_code == 0 and note in result.stdout, result.output
    (mdir / "config.json").unlink()
    line = error_line(run(["plan", "--model-dir", str(mdir), *SMALL], tmp_path))
    assert line.startswith(f"{props}:1: option.model_id=/opt/ml/model: no such file or directory"), line


def test_validate_checks_lmcache_variables_alone(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path)
    result = run(["validate", "--model-dir", str(mdir), *SMALL], tmp_path, LMCACHE_CHUNK_SIZE="100")
    assert result.exit_code == 1, result.output
    assert "environment variable LMCACHE_CHUNK_SIZE=100: must be a positive multiple" in result.stdout
    assert "override" not in result.stdout  # no file for them to override
    assert result.stdout.strip().endswith("LMCACHE_* variables: 1 error(s), 0 warning(s) (host from ml.g5.2xlarge)")


def test_a_yaml_directory_named_by_the_settings_says_so(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.max_model_len=8192\noption.lmcache_config_file=conf\n")
    (mdir / "conf").mkdir()
    expected = f"{mdir / 'serving.properties'}:2: option.lmcache_config_file: {mdir / 'conf'} is a directory, not " \
               "an LMCache YAML file; name the file"
    for args in (["serve", "--dry-run"], ["plan"]):
        assert error_line(run([*args, "--model-dir", str(mdir), *SMALL], tmp_path)) == expected
    line = error_line(run(["validate", "--model-dir", str(mdir), *SMALL], tmp_path))
    assert line == f"{mdir / 'conf'}: is a directory, not an LMCache YAML file; name the file"


def test_a_hub_id_without_a_network_fails_at_once_saying_how_to_use_a_local_directory(tmp_path: Path) -> None:
    # Port 9 on the loopback refuses at once: the Hub is unreachable, as on a laptop offline.
    result = run(["plan", "--model", "some-org/some-model", *SMALL], tmp_path, HF_ENDPOINT="http://127.0.0.1:9",
                 HF_HOME=str(tmp_path / "hf"))
    line = error_line(result)
    assert line.startswith("--model=some-org/some-model: not in the local Hugging Face cache, and the Hub cannot be "
                           "reached (127.0.0.1: "), line
    assert "give a local directory with config.json instead (--model DIR" in line
