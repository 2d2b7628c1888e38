"""vLLM job scripts forked from a process that imported vLLM once (test process).

Importing torch, vLLM and transformers takes about 8 s of one core with
compiled bytecode: more than a tiny model's whole engine start after it. So
each ``run_llm.py`` / ``run_blend_llm.py`` job is forked from a multiprocessing
forkserver that imported vLLM's modules once (``PRELOAD``), instead of being a
new interpreter. The child is still a fresh process for vLLM and lmi-cache: no
engine is built and no torch operator runs before the fork (so no OpenMP thread
pool is lost across it), and nothing of lmi-cache is imported there, so a job
that restarts from a disk tier sees what a new server would. Its environment,
working directory, ``sys.path`` (``PYTHONPATH`` entries first, as a new
interpreter would) and stdout/stderr are set as for a subprocess.
``LMI_CACHE_E2E_FORK=0`` runs each job as a new interpreter again.

Before its first engine, each vLLM process inspects the model's class (multimodal? pooling? ...) in a new
interpreter that imports vLLM again, about 10 s of one core, unless the model-info cache already holds it
(``tests/vllm_cache.py`` shares one cache per session). :func:`warm_model_infos` fills that cache for
every architecture of the suite's models in one child of the forkserver, in about a second.

The forkserver is a new interpreter with the default ``sys.path`` (CPython 3.11
does not apply the one it is handed), and it skips a preload module that fails
to import without a word: so ``PRELOAD`` names modules of site-packages only, and
each child checks that they are there.
"""
from __future__ import annotations

import fcntl
import functools
import multiprocessing
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Mapping
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import NamedTuple

FORK = os.environ.get("LMI_CACHE_E2E_FORK", "1") != "0"


class Finished(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


# vLLM's LLM entry point, and what building a CPU engine for a Llama-shaped model imports (measured: about
# 1 s less per job than the entry point alone); other models' modules are imported in the job.
PRELOAD = ["vllm.entrypoints.llm", "vllm.config", "vllm.inputs", "vllm.lora.request", "vllm.sampling_params",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.attention.backends.cpu_attn",
           "vllm.model_executor.model_loader", "vllm.model_executor.models.llama", "compressed_tensors"]


@functools.cache
def _forkserver() -> BaseContext:
    context = multiprocessing.get_context("forkserver")
    # Imported once in the forkserver; one it cannot import is skipped without a word (hence _child's check).
    context.set_forkserver_preload(PRELOAD)
    return context


def _child(script: str, args: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """In the forked child: become ``python script args`` with ``env`` in ``cwd``, output to two files."""
    missing = [name for name in PRELOAD if name not in sys.modules]
    assert not missing, f"the e2e forkserver did not import {missing} (see warm_start.PRELOAD)"
    # The code under test must start fresh in each job: the forkserver imports vLLM only.
    assert not any(name == "lmi_cache" or name.startswith("lmi_cache.") for name in sys.modules), \
        "the e2e forkserver imported lmi_cache before forking a job"
    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [str(Path(script).parent), *extra]
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # the job's own failure: its traceback is its output, as for a subprocess
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The vLLM architectures of the suite's models: the tiny models of ``lmi_cache.devtools``, the speculative
# drafters and MTP layers of ``spec_heads.py``, the MLA and audio models. One missing here is still
# inspected, by vLLM itself (10 s); a name vLLM does not know fails the warm-up.
MODEL_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM", "GraniteMoeHybridForCausalLM",
    "EagleLlamaForCausalLM", "Eagle3LlamaForCausalLM", "MiMoForCausalLM", "MiMoMTPModel",
    "DeepseekV2ForCausalLM", "Qwen2AudioForConditionalGeneration",
)


def _warm_child(cache_root: str, architectures: tuple[str, ...], stderr: str) -> None:
    """In a forked child: vLLM's own model-info cache entries, each inspected here instead of in a new interpreter."""
    handle = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(handle, 2)
    code = 0
    try:
        os.environ["VLLM_CACHE_ROOT"] = cache_root  # read by vLLM when it reads or writes the cache
        from vllm.model_executor.models import registry

        # vLLM inspects in a new interpreter so that no CUDA context is made in its own process; this child
        # has none to protect and exits right after. The cache files are vLLM's own (same keys and hashes).
        registry._run_in_subprocess = lambda fn: fn()
        infos = Path(cache_root) / "modelinfos"  # the session's shared folder (a link), or a folder of its own
        infos.mkdir(parents=True, exist_ok=True)
        with open(infos / ".warm.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one worker inspects; the other then finds every entry cached
            for name in architectures:
                if name not in registry.ModelRegistry.models:
                    raise KeyError(f"tests/e2e/warm_start.py: vLLM knows no architecture {name!r} (MODEL_ARCHITECTURES)")
                registry.ModelRegistry.models[name].inspect_model_cls()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)


def warm_model_infos(cache_root: Path, timeout_s: float = 120.0) -> None:
    """Fill the model-info cache under ``cache_root`` (made by ``vllm_cache.vllm_cache_root``) for every
    architecture in ``MODEL_ARCHITECTURES``; nothing to do when jobs are not forked."""
    if not FORK:
        return
    stderr = cache_root.parent / "warm-model-infos.txt"
    process = _forkserver().Process(  # type: ignore[attr-defined]
        target=_warm_child, args=(str(cache_root), MODEL_ARCHITECTURES, str(stderr)), daemon=False)
    process.start()
    process.join(timeout_s)
    if process.exitcode is None:
        process.kill()
        process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"filling vLLM's model-info cache failed ({process.exitcode}):\n"
                           f"{stderr.read_text(errors='replace')[-3000:] if stderr.exists() else ''}")


def run_script(script: Path, args: list[str], env: Mapping[str, str], cwd: Path, timeout_s: float) -> Finished:
    """Run ``python script args`` (forked from the warm forkserver unless LMI_CACHE_E2E_FORK=0)."""
    stdout, stderr = cwd / "stdout.txt", cwd / "stderr.txt"
    if not FORK:
        proc = subprocess.run([sys.executable, str(script), *args], env=dict(env), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout_s)
        stdout.write_text(proc.stdout)
        stderr.write_text(proc.stderr)
        return Finished(proc.returncode, proc.stdout, proc.stderr)
    process = _forkserver().Process(  # type: ignore[attr-defined]
        target=_child, args=(str(script), args, dict(env), str(cwd), str(stdout), str(stderr)), daemon=False)
    process.start()
    process.join(timeout_s)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise subprocess.TimeoutExpired([str(script), *args], timeout_s)
    return Finished(process.exitcode, stdout.read_text(errors="replace"), stderr.read_text(errors="replace"))
