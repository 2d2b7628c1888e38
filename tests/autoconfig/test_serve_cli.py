"""``lmi-cache serve`` as a process: fail-fast errors, --dry-run, and exec semantics."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

GIB = 1 << 30
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
REPO = Path(__file__).resolve().parents[2]


def host_json(tmp_path: Path, num_gpus: int) -> Path:
    snapshot = {
        "gpus": [{"index": i, "name": "NVIDIA L40S", "memory_total_bytes": 48 * GIB, "memory_free_bytes": 47 * GIB}
                 for i in range(num_gpus)],
        "memory": {"total_bytes": 256 * GIB, "available_bytes": 250 * GIB, "cgroup_limit_bytes": None,
                   "memlock_limit_bytes": None, "shm_bytes": 64 * GIB},
        "disks": [],
        "cpu_count": 48,
    }
    path = tmp_path / f"host-{num_gpus}.json"
    path.write_text(json.dumps(snapshot))
    return path


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "autoconfig.cli_serve", "serve", *args]


def run_serve(tmp_path: Path, properties: str, num_gpus: int = 1, env: dict[str, str] | None = None,
              ) -> subprocess.CompletedProcess[str]:
    mdir = tmp_path / "model"
    mdir.mkdir(exist_ok=True)
    shutil.copy(FIXTURES / "llama-3.1-8b-instruct" / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text(properties)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SM_", "HF_MODEL"))}
    full_env.update({"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "rt"), "PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run(serve_cmd("--model-dir", str(mdir), "--host-snapshot", str(host_json(tmp_path, num_gpus)),
                                    "--dry-run"),
                          capture_output=True, text=True, env=full_env, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize(
    ("properties", "num_gpus", "expected"),
    [
        ("option.lmcache_auto_config=true\noption.lmcache_config_file=lmcache.yaml\n", 1,
         "option.lmcache_auto_config=true and"),
        ("option.lmcache_auto_config=enabled\n", 1, "option.lmcache_auto_config='enabled': must be true or false"),
        ("option.tensor_parallel_degree=4\n", 2, "needs 4 GPUs but this host has 2"),
        ("option.tensor_parallel_degree=4\noption.lmcache_auto_config=true\n", 2, "this host has 2"),
        ("option.max_rolling_batch_sise=8\n", 1, "did you mean option.max_rolling_batch_size?"),
    ],
)
def test_bad_settings_exit_2_with_one_line_and_no_traceback(
    tmp_path: Path, properties: str, num_gpus: int, expected: str
) -> None:
    started = time.monotonic()
    proc = run_serve(tmp_path, properties, num_gpus)
    elapsed_s = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("lmi-cache: error: ")
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "exec:" not in proc.stdout
    # Fails before any model or vLLM is loaded: seconds, not the minute vLLM takes to start.
    assert elapsed_s < 20


def test_env_setting_errors_name_the_variable(tmp_path: Path) -> None:
    proc = run_serve(tmp_path, "", env={"OPTION_ENABLE_PREFIX_CACHING": "sometimes"})
    assert proc.returncode == 2
    assert "OPTION_ENABLE_PREFIX_CACHING" in proc.stderr and "expected true or false" in proc.stderr


def test_dry_run_prints_summary_and_command(tmp_path: Path) -> None:
    proc = run_serve(tmp_path, "option.lmcache_auto_config=true\noption.rolling_batch=vllm\n",
                     env={"SAGEMAKER_BIND_TO_PORT": "8123"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "lmi-cache serve: option lmcache_auto_config = true" in out
    assert "cache: auto-configured" in out
    assert "option.rolling_batch=vllm ignored" in out
    exec_line = next(line for line in out.splitlines() if line.startswith("exec: "))
    assert "-m vllm.entrypoints.openai.api_server --host 0.0.0.0 --port 8123" in exec_line
    assert "LmiCacheConnector" in exec_line
    assert not (tmp_path / "rt").exists(), "--dry-run writes no files"


def test_prepare_launch_imports_neither_vllm_nor_torch(tmp_path: Path) -> None:
    mdir = tmp_path / "model"
    mdir.mkdir()
    shutil.copy(FIXTURES / "llama-3.1-8b-instruct" / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text("option.lmcache_auto_config=true\n")
    code = textwrap.dedent(f"""
        import sys
        from autoconfig.serve.launch import load_host_file, prepare_launch
        prepare_launch({str(mdir)!r}, {{}}, host=load_host_file({str(host_json(tmp_path, 1))!r}),
                       output_dir={str(tmp_path / 'rt')!r})
        print(sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_server_runs_as_a_child_with_serves_environment_and_passes_its_exit_code(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import os, sys
        from autoconfig.serve.launch import ServeLaunch, run_launch
        print(os.getpid(), flush=True)
        child = "import os, sys; print(os.getppid(), os.environ['MARK'], flush=True); sys.exit(7)"
        sys.exit(run_launch(ServeLaunch([sys.executable, "-c", child], {**os.environ, "MARK": "set"}, {}, "off")))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 7
    serve_pid, child_line = proc.stdout.split("\n")[:2]
    assert child_line.split() == [serve_pid, "set"], "serve is the server's parent and passes the env"


def test_version_names_the_package_and_the_vllm_it_targets() -> None:
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "autoconfig.cli", "--version"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"lmi-cache {version('lmi-cache')} (vLLM arguments of vLLM 0.32.0)"
