"""The two packages type-check: mypy is clean on lmi_cache and autoconfig (the seams are typed, no Any to hide in).

mypy runs once per session, started in the background at collection (``tests/conftest.py``: ``mypy_run``).
"""
from __future__ import annotations

import ast
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_is_clean_on_both_packages(mypy_run: subprocess.CompletedProcess[str]) -> None:
    assert mypy_run.returncode == 0, mypy_run.stdout[-4000:] + mypy_run.stderr[-2000:]
    assert "Success: no issues found" in mypy_run.stdout


def _vllm_modules_imported(package: Path) -> set[str]:
    found: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found.update(name for name in names if name == "vllm" or name.startswith("vllm."))
    return found


def test_mypy_reads_every_vllm_module_the_packages_import() -> None:
    # pyproject.toml has mypy skip vLLM's import graph except the modules named there: a module imported
    # without being named would be Any to mypy, unseen.
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    read = {module for override in config["tool"]["mypy"]["overrides"]
            if override.get("follow_imports") == "normal" for module in override["module"]}
    imported = _vllm_modules_imported(REPO / "lmi_cache") | _vllm_modules_imported(REPO / "autoconfig")
    assert imported, "no vLLM import found: the scan is wrong"
    assert imported <= read, f"add to pyproject.toml's follow_imports = 'normal' list: {sorted(imported - read)}"
