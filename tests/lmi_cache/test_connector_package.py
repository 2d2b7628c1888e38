"""The connector package: vLLM finds the connector by module path and name; its other parts import without vLLM."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_the_index_and_metadata_import_without_vllm() -> None:
    code = ("import sys, lmi_cache.vllm_connector.key_index, lmi_cache.vllm_connector; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.vllm
def test_vllm_finds_the_connector_by_module_path_and_name() -> None:
    # What vLLM's connector factory does with kv_connector_module_path and kv_connector.
    from lmi_cache.vllm_connector.connector import LmiCacheConnector

    module = importlib.import_module("lmi_cache.vllm_connector")
    assert getattr(module, "LmiCacheConnector") is LmiCacheConnector
    with pytest.raises(AttributeError):
        getattr(module, "NoSuchConnector")
