"""Compile a torch C++/CUDA extension on first use into a cache directory (any process).

``load_or_build`` builds against the torch that is already imported (no build
isolation, no second torch download) with ``torch.utils.cpp_extension`` and
ninja, once per (sources, compiler flags, torch, Python, CPU architecture):
that tuple is hashed into the build directory's name. Safe under concurrency:
an exclusive ``flock`` (released by the kernel if the holder dies) serialises
builders, the finished build is moved into place with one rename, and a
later process finds the built library and imports it without compiling. A
failed build leaves a ``.failed`` note so other processes do not retry it;
delete the note (or the cache directory) to retry. Only ``kernels`` calls this.

Every load marks its build as used (its lock file's mtime). Each new build
removes the builds of the same extension that no process has loaded for
``PRUNE_UNUSED_DAYS`` (an upgrade of lmi-cache or torch otherwise leaves its
old build behind forever); a build still mapped by a running process keeps
working, since Linux keeps an unlinked library mapped.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

CACHE_DIR_ENV = "LMI_CACHE_KERNELS_DIR"
PRUNE_UNUSED_DAYS = 30
KEY_LENGTH = 20  # hex digits of a build key (build_key makes them; pruning recognises them)
# What one build key leaves beside its build directory: its lock, a failure note and log, a staging dir.
_ENTRY_SUFFIXES = (".lock", ".failed", ".log", ".building")


class NativeBuildError(RuntimeError):
    """The extension could not be compiled or loaded; ``str()`` is one line saying why."""


def default_cache_root() -> Path:
    """``$LMI_CACHE_KERNELS_DIR``, else ``$XDG_CACHE_HOME/lmi-cache/kernels``, else ``~/.cache/...``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "lmi-cache" / "kernels"


def build_key(name: str, files: Sequence[Path], flags: Sequence[str]) -> str:
    """Hash of everything the built library depends on."""
    digest = hashlib.sha256()
    for part in (name, torch.__version__, str(torch.version.cuda), sys.version, platform.machine(), *flags):
        digest.update(part.encode() + b"\0")
    for path in sorted(files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:KEY_LENGTH]


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _import_library(name: str, library: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, str(library), loader=loader)
    if spec is None:
        raise NativeBuildError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _compiler_problem() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH)"
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.is_file():
        return f"no Python headers ({python_h} missing: install python3-dev)"
    if shutil.which("ninja") is None:
        return "ninja not found (pip install ninja, or apt-get install ninja-build)"
    return None


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    # A venv's ninja (pip package) is not on PATH when python is run without activating the venv.
    saved = os.environ.get("PATH", "")
    extra = [str(Path(sys.executable).parent)]
    try:
        import ninja  # type: ignore[import-not-found]

        extra.insert(0, str(ninja.BIN_DIR))
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join([*extra, saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def load_or_build(
    name: str,
    sources: Sequence[Path],
    *,
    depends: Sequence[Path] = (),
    cache_root: Path | None = None,
    with_cuda: bool = False,
    extra_cflags: Sequence[str] = (),
    extra_cuda_cflags: Sequence[str] = (),
) -> tuple[ModuleType, bool]:
    """The extension module and whether this call compiled it; raises :class:`NativeBuildError`."""
    root = cache_root or default_cache_root()
    flags = [f"cuda={with_cuda}", *extra_cflags, "|", *extra_cuda_cflags]
    try:
        key = build_key(name, [*sources, *depends], flags)
        root.mkdir(parents=True, exist_ok=True)
        return _load_or_build(name, sources, root, key, with_cuda, extra_cflags, extra_cuda_cflags)
    except OSError as err:  # unwritable cache, full disk: the caller falls back or refuses, with this line
        raise NativeBuildError(f"kernel cache {root}: {err.strerror or err} ({getattr(err, 'filename', '')})") from None
    except ImportError as err:
        raise NativeBuildError(f"cannot load the built kernels: {err}") from None


def _load_or_build(name: str, sources: Sequence[Path], root: Path, key: str, with_cuda: bool,
                   extra_cflags: Sequence[str], extra_cuda_cflags: Sequence[str]) -> tuple[ModuleType, bool]:
    final = root / f"{name}-{key}"
    library = final / f"{name}.so"
    failed = root / f"{name}-{key}.failed"
    lock = root / f"{name}-{key}.lock"
    if library.is_file():
        _mark_used(lock)
        return _import_library(name, library), False
    with _exclusive(lock):
        _mark_used(lock)
        if library.is_file():  # another process built it while we waited
            return _import_library(name, library), False
        if failed.is_file():
            raise NativeBuildError(f"{failed.read_text().strip()} (delete {failed} to retry)")
        with _ninja_on_path():
            problem = _compiler_problem()
            if problem is not None:
                raise NativeBuildError(problem)
            staging = root / f"{name}-{key}.building"
            shutil.rmtree(staging, ignore_errors=True)  # a crashed builder's leftovers; we hold the lock
            staging.mkdir()
            try:
                from torch.utils import cpp_extension

                module = cpp_extension.load(
                    name,
                    [str(s) for s in sources],
                    extra_cflags=list(extra_cflags),
                    extra_cuda_cflags=list(extra_cuda_cflags),
                    build_directory=str(staging),
                    with_cuda=with_cuda,
                    verbose=False,
                )
            except Exception as err:  # noqa: BLE001 - compiler output becomes a log file and one line
                log = root / f"{name}-{key}.log"
                log.write_text(str(err))
                lines = [ln for ln in str(err).splitlines() if ln.strip()]
                # The compiler's first diagnostic ("file:line:col: error: ...") says most.
                first = next((ln for ln in lines if ": error:" in ln or ": fatal error:" in ln),
                             lines[0] if lines else type(err).__name__)
                failed.write_text(f"compiling {name} failed: {first.strip()[-200:]}; full log {log}")
                raise NativeBuildError(failed.read_text()) from None
        shutil.rmtree(final, ignore_errors=True)  # an incomplete earlier attempt
        os.rename(staging, final)
        prune_unused(root, name, keep=key)
        return module, True


def _mark_used(lock: Path) -> None:
    try:
        lock.touch()
    except OSError:
        pass  # a read-only cache still loads; it is only never pruned


def _is_key(text: str) -> bool:
    return len(text) == KEY_LENGTH and all(c in "0123456789abcdef" for c in text)


def prune_unused(root: Path, name: str, keep: str, max_age_days: float = PRUNE_UNUSED_DAYS) -> list[str]:
    """Remove the builds of ``name`` other than ``keep`` whose files are all older than ``max_age_days``.

    Returns the keys removed. Never raises: pruning is housekeeping.
    """
    cutoff = time.time() - max_age_days * 86400
    entries: dict[str, list[Path]] = {}
    prefix = f"{name}-"
    try:
        for path in root.iterdir():
            if not path.name.startswith(prefix):
                continue
            rest = path.name[len(prefix):]
            key = next((rest[: -len(suffix)] for suffix in _ENTRY_SUFFIXES if rest.endswith(suffix)), rest)
            if _is_key(key):  # only what build_key names; anything else in the directory is left alone
                entries.setdefault(key, []).append(path)
    except OSError:
        return []
    removed = []
    for key, paths in entries.items():
        if key == keep:
            continue
        try:
            if max(p.stat().st_mtime for p in paths) >= cutoff:
                continue  # loaded, built or failed recently
            for path in paths:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            removed.append(key)
        except OSError:
            continue
    return removed
