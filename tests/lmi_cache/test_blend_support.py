"""The container-start check (``blend_refusal``, torch-free) and the worker's (``check_blendable``) agree."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmi_cache.blend.rope import SUPPORTED_ROPE_TYPES
from lmi_cache.blend.settings import BlendConfigError
from lmi_cache.blend.support import BLENDABLE_ROPE_TYPES, blend_refusal, check_blendable

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "tests" / "fixtures" / "hf_configs").glob("*/config.json"))


def test_rope_types_match_what_rope_rerotates() -> None:
    assert BLENDABLE_ROPE_TYPES == SUPPORTED_ROPE_TYPES


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.parent.name)
def test_both_checks_agree_on_every_fixture_model(path: Path) -> None:
    config = json.loads(path.read_text())
    reason = blend_refusal(config, path.parent.name)
    try:
        check_blendable(config, path.parent.name)
    except BlendConfigError as err:
        assert reason is not None and reason in str(err)
    else:
        assert reason is None


def test_covered_and_refused_fixture_models() -> None:
    covered = {p.parent.name for p in CONFIGS if blend_refusal(json.loads(p.read_text())) is None}
    assert {"llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "qwen3-8b"} <= covered
    assert not covered & {"gemma-2-9b-it", "mistral-7b-v0.1", "deepseek-v3", "falcon-7b"}


def test_the_start_check_imports_no_torch() -> None:
    code = ("import sys; from lmi_cache.blend.support import blend_refusal; "
            "assert blend_refusal({'model_type': 'gemma2'}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_mistral_config_without_a_window_gets_the_window_the_worker_sees() -> None:
    from transformers import MistralConfig

    from lmi_cache.blend.support import MISTRAL_DEFAULT_SLIDING_WINDOW

    assert MistralConfig().sliding_window == MISTRAL_DEFAULT_SLIDING_WINDOW
    raw = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    assert "sliding-window" in (blend_refusal(raw) or "")  # transformers fills in 4096: the worker refuses it too
    assert blend_refusal({**raw, "sliding_window": None}) is None  # explicitly none: covered
    hf = MistralConfig(**{k: v for k, v in raw.items() if k != "model_type"}).to_dict()
    assert (blend_refusal(raw) is None) == (blend_refusal(hf) is None)  # what container start and worker read
