"""Building and choosing the native kernels: LMI_CACHE_KERNELS, fallback, cache, concurrency, CUDA sources.

Subprocesses stand in for vLLM worker processes: each resolves the backend
on its own, as a worker does at ``register_kv_caches``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from lmi_cache.transfer import kernels, native_build

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"


def run_py(code: str, env_extra: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (kernels.KERNELS_ENV, native_build.CACHE_DIR_ENV)}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


BACKEND_CLI = "from lmi_cache.transfer.kernels import main; raise SystemExit(main())"
NO_COMPILER = {"CXX": "/nonexistent/c++"}


def test_invalid_choice_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.KERNELS_ENV, "fast")
    kernels.reset()
    try:
        with pytest.raises(kernels.KernelBackendError, match="LMI_CACHE_KERNELS='fast' is not one of native, torch, auto"):
            kernels.backend()
    finally:
        kernels.reset()


def test_torch_choice_never_touches_the_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    proc = run_py(BACKEND_CLI, {kernels.KERNELS_ENV: "torch", native_build.CACHE_DIR_ENV: str(tmp_path), **NO_COMPILER})
    assert proc.returncode == 0 and proc.stdout.strip() == "torch", proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_without_a_compiler_auto_falls_back_with_one_line_and_native_refuses(tmp_path: Path) -> None:
    auto = run_py(BACKEND_CLI, {native_build.CACHE_DIR_ENV: str(tmp_path), **NO_COMPILER})
    assert auto.returncode == 0 and auto.stdout.strip() == "torch"
    lines = auto.stderr.strip().splitlines()
    assert len(lines) == 1 and "native KV copy kernels unavailable (no C++ compiler" in lines[0], auto.stderr
    native = run_py(BACKEND_CLI, {kernels.KERNELS_ENV: "native", native_build.CACHE_DIR_ENV: str(tmp_path),
                                  **NO_COMPILER})
    assert native.returncode == 2 and native.stderr == ""
    assert native.stdout.strip().splitlines() == [
        "error: LMI_CACHE_KERNELS=native but the native kernels cannot load: no C++ compiler ('/nonexistent/c++' "
        "not on PATH); install g++ and ninja, or set LMI_CACHE_KERNELS=torch"
    ]


def test_an_unusable_cache_directory_falls_back_with_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_py(BACKEND_CLI, {native_build.CACHE_DIR_ENV: str(blocker / "kernels")})
    assert proc.returncode == 0 and proc.stdout.strip() == "torch"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"kernel cache {blocker / 'kernels'}" in lines[0], proc.stderr


def test_a_second_process_loads_the_cached_build_without_a_compiler() -> None:
    kernels.load_extension()  # builds into the default cache on a fresh machine, else loads it
    env = {kernels.KERNELS_ENV: "native", "PATH": "/nonexistent", **NO_COMPILER}
    proc = run_py(BACKEND_CLI, env)
    assert proc.returncode == 0 and proc.stdout.strip() == "native", proc.stdout + proc.stderr
    assert "compiled" not in proc.stderr


TINY_SOURCE = """
#include <pybind11/pybind11.h>
int answer() { return ANSWER; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
BUILD_ONE = """
import json, sys
from pathlib import Path
from lmi_cache.transfer.native_build import load_or_build, NativeBuildError
try:
    mod, built = load_or_build("lmi_tiny", [Path(sys.argv[1])], cache_root=Path(sys.argv[2]),
                               extra_cflags=["-DANSWER=42"])
    print(json.dumps({"built": built, "answer": mod.answer()}))
except NativeBuildError as err:
    print(json.dumps({"error": str(err)}))
"""


def _build_procs(src: Path, root: Path, count: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != native_build.CACHE_DIR_ENV}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_ONE, str(src), str(root)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for _ in range(count)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow
def test_concurrent_first_use_compiles_once_and_every_process_loads(tmp_path: Path) -> None:
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_SOURCE)
    results = _build_procs(src, tmp_path / "cache", 3)
    assert sorted(r["built"] for r in results) == [False, False, True]
    assert all(r["answer"] == 42 for r in results)
    assert _build_procs(src, tmp_path / "cache", 1) == [{"built": False, "answer": 42}]
    # A changed source is a different build, not the stale library; building it prunes builds
    # unused for PRUNE_UNUSED_DAYS (here: the first one, aged by hand), nothing recent.
    first = sorted(p.name for p in (tmp_path / "cache").iterdir())
    _age(tmp_path / "cache", native_build.PRUNE_UNUSED_DAYS + 1)
    src.write_text(TINY_SOURCE.replace("ANSWER", "ANSWER + 1"))
    assert _build_procs(src, tmp_path / "cache", 1) == [{"built": True, "answer": 43}]
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert not set(first) & set(left) and any(name.endswith(".lock") for name in left), (first, left)


def _age(root: Path, days: float) -> None:
    old = time.time() - days * 86400
    for path in root.iterdir():
        os.utime(path, (old, old))


def _fake_entry(root: Path, key: str, days_old: float) -> None:
    (root / f"lmi_tiny-{key}").mkdir()
    (root / f"lmi_tiny-{key}" / "lmi_tiny.so").write_bytes(b"not a library")
    (root / f"lmi_tiny-{key}.lock").touch()
    old = time.time() - days_old * 86400
    for path in (root / f"lmi_tiny-{key}", root / f"lmi_tiny-{key}.lock"):
        os.utime(path, (old, old))


def test_pruning_removes_only_other_builds_unused_for_the_period(tmp_path: Path) -> None:
    stale, recent, mine = "a" * 20, "b" * 20, "c" * 20
    for key, days in ((stale, 40), (recent, 3), (mine, 40)):
        _fake_entry(tmp_path, key, days)
    (tmp_path / "lmi_tiny-notakey").mkdir()  # not a build key: never touched
    os.utime(tmp_path / "lmi_tiny-notakey", (0, 0))
    (tmp_path / f"other-{'d' * 20}").mkdir()  # another extension's build
    assert native_build.prune_unused(tmp_path, "lmi_tiny", keep=mine) == [stale]
    left = {p.name for p in tmp_path.iterdir()}
    assert not any(stale in name for name in left)
    assert {f"lmi_tiny-{recent}", f"lmi_tiny-{mine}", "lmi_tiny-notakey", f"other-{'d' * 20}"} <= left


def test_loading_a_build_marks_it_used(tmp_path: Path) -> None:
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_SOURCE)
    key = native_build.build_key("lmi_tiny", [src], ["cuda=False", "|"])
    root = tmp_path / "cache"
    root.mkdir()
    _fake_entry(root, key, 40)
    with pytest.raises(native_build.NativeBuildError):  # the fake library does not import
        native_build.load_or_build("lmi_tiny", [src], cache_root=root)
    assert time.time() - (root / f"lmi_tiny-{key}.lock").stat().st_mtime < 60


@pytest.mark.slow
def test_a_failed_build_is_one_line_with_its_log_and_is_not_retried_by_others(tmp_path: Path) -> None:
    src = tmp_path / "broken.cpp"
    src.write_text(TINY_SOURCE.replace("return ANSWER;", "return undefined_name;"))
    (first,) = _build_procs(src, tmp_path / "cache", 1)
    assert "compiling lmi_tiny failed" in first["error"] and "undefined_name" in first["error"]
    assert "\n" not in first["error"]
    log = next((tmp_path / "cache").glob("lmi_tiny-*.log"))
    assert "undefined_name" in log.read_text()
    (second,) = _build_procs(src, tmp_path / "cache", 1)
    assert second["error"].startswith(first["error"]) and "to retry" in second["error"]


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no CUDA toolkit (nvcc) on this machine")
@pytest.mark.parametrize("flags", [["-std=c++17"], ["-std=c++20", "-arch=sm_90", "--expt-relaxed-constexpr"]])
def test_cuda_kernel_compiles_with_nvcc(tmp_path: Path, flags: list[str]) -> None:
    assert NVCC is not None
    cmd = [NVCC, *flags, "-O3", "-Werror", "all-warnings", "-c", str(CSRC / "paged_copy_cuda.cu"),
           "-o", str(tmp_path / "k.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "k.o").stat().st_size > 0




def _cuda_include() -> Path | None:
    # /usr/local/bin/nvcc is often a wrapper script, so look in the usual toolkit homes too.
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        homes.insert(0, str(Path(NVCC).resolve().parents[1]))
    found = [Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime.h").is_file()]
    return found[0] if NVCC and found else None


CUDA_INCLUDE = _cuda_include()


@pytest.mark.slow
@pytest.mark.skipif(CUDA_INCLUDE is None, reason="no CUDA toolkit headers on this machine")
def test_cuda_branch_of_the_torch_binding_compiles(tmp_path: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    # CPU wheels of torch ship the c10/cuda headers but not this one generated file.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [*include_paths(), sysconfig.get_paths()["include"], str(tmp_path), str(CUDA_INCLUDE)]
    cmd = [os.environ.get("CXX", "c++"), "-std=c++20", "-fsyntax-only", "-Wall",
           "-DLMI_CACHE_WITH_CUDA", "-DTORCH_EXTENSION_NAME=lmi_cache_kernels",
           *(f"-I{p}" for p in includes), str(CSRC / "bindings.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    ours = [ln for ln in proc.stderr.splitlines() if "csrc/" in ln]
    assert proc.returncode == 0 and not ours, proc.stderr[-3000:]
