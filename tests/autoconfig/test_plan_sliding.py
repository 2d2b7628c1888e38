"""Plans for sliding-window models: golden outputs and the hybrid KV cache manager's GPU capacity.

Regenerate the golden files after an intended change with
``LMI_CACHE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/autoconfig/test_plan_sliding.py``
and review the diff.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_cli import HOSTS, MODELS, _golden, _run

from autoconfig.model.kv import hybrid_group_layers

# (golden name, model fixture, extra arguments, layers, windowed layers, layers per hybrid group)
CASES = [
    ("plan_gpt_oss_20b_a10g", "gpt-oss-20b", ["--max-model-len", "16384", "--host-snapshot", f"{HOSTS}/a10g_container_memlock.json"],
     24, 12, 12),
    ("plan_gemma2_9b_a10g", "gemma-2-9b-it", ["--max-model-len", "4096", "--host-snapshot", f"{HOSTS}/a10g_container_memlock.json"],
     42, 21, 21),
    ("plan_gemma3_27b_tp2_a100x8", "gemma-3-27b-it", ["--tp", "2", "--host-snapshot", f"{HOSTS}/a100x8_nvme_cgroup.json"],
     62, 52, 10),
]


def _plan(model: str, args: list[str]) -> dict[str, Any]:
    result = _run(["plan", "--model", model, *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize(("name", "model", "args", "layers", "sliding", "group"), CASES, ids=[c[0] for c in CASES])
def test_sliding_window_plan_golden(name: str, model: str, args: list[str], layers: int, sliding: int, group: int) -> None:
    result = _run(["plan", "--model", f"{MODELS}/{model}", *args, "--json"])
    assert result.exit_code == 0, result.output
    assert hybrid_group_layers(layers, sliding) == group
    _golden(f"{name}.json", result.stdout)


@pytest.mark.parametrize(("name", "model", "args", "layers", "sliding", "group"), CASES, ids=[c[0] for c in CASES])
def test_gpu_capacity_counts_one_group_of_layers(tmp_path: Path, name: str, model: str, args: list[str], layers: int,
                                                 sliding: int, group: int) -> None:
    """The same model with every layer full attention holds layers/group times fewer tokens in the same memory."""
    # A short max_model_len: Gemma 2 9B on one A10G fits a 4096-token sequence only with the hybrid manager.
    args = [("512" if prev == "--max-model-len" else a) for prev, a in zip(["", *args], args)]
    with_window = _plan(f"{MODELS}/{model}", args)
    config = json.loads((Path(MODELS) / model / "config.json").read_text())
    text = config.get("text_config", config)
    text["layer_types"] = ["full_attention"] * layers  # same model, same weights, no windowed layer
    plain = tmp_path / model
    shutil.copytree(Path(MODELS) / model, plain)
    (plain / "config.json").write_text(json.dumps(config))
    without = _plan(str(plain), args)
    hybrid, full = with_window["gpu"]["kv_capacity_tokens"], without["gpu"]["kv_capacity_tokens"]
    assert with_window["gpu"]["kv_bytes_per_rank"] == without["gpu"]["kv_bytes_per_rank"]
    # Tokens are whole blocks (16 on CUDA): the ratio holds up to one block of rounding.
    assert abs(hybrid - full * layers / group) <= 16 * layers / group + 16, (hybrid, full)
    # The tiers still store every layer of every chunk: bytes per token are the whole model's.
    assert with_window["model"]["kv_bytes_per_token"] == without["model"]["kv_bytes_per_token"]
    assert any("hybrid KV cache manager groups layers" in line for line in with_window["explanation"]), with_window["explanation"]
