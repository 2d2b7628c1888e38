"""One package holds the vLLM glue: nothing else in lmi_cache or autoconfig imports vLLM, and the rest imports without it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GLUE = REPO / "lmi_cache" / "vllm_connector"


def _vllm_imports(path: Path) -> list[int]:
    """Lines of ``path`` that import vLLM (at any depth: in functions and TYPE_CHECKING blocks too)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name == "vllm" or name.startswith("vllm.") for name in names):
            lines.append(node.lineno)
    return lines


def test_only_the_glue_package_imports_vllm() -> None:
    offenders = []
    for root in (REPO / "lmi_cache", REPO / "autoconfig"):
        for path in sorted(root.rglob("*.py")):
            if path.is_relative_to(GLUE):
                continue
            offenders += [f"{path.relative_to(REPO)}:{line}" for line in _vllm_imports(path)]
    assert offenders == [], f"vLLM imported outside lmi_cache/vllm_connector: {offenders}"


def test_the_scan_sees_imports_in_functions_and_type_checking_blocks(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vllm.config import VllmConfig\n"
                     "def f():\n    import vllm.v1\n    from vllmx import y\n")
    assert _vllm_imports(probe) == [3, 5]


def test_metadata_and_the_blend_algorithm_import_without_vllm() -> None:
    modules = ["lmi_cache.vllm_connector", "lmi_cache.vllm_connector.metadata",
               "lmi_cache.blend", "lmi_cache.blend.blender", "lmi_cache.blend.scheduler_plan",
               "lmi_cache.blend.worker_jobs", "lmi_cache.blend.settings", "lmi_cache.blend.connector",
               "lmi_cache.front.middleware", "lmi_cache.front.options"]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('vllm' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
