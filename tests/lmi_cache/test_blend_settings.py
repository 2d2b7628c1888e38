"""BlendSettings: LMCache's blending keys parsed from YAML values and env strings, with one-line errors."""
from __future__ import annotations

import pytest

from lmi_cache.blend.settings import BLEND_KEYS, BlendConfigError, BlendSettings
from lmi_cache.errors import ConfigError


def test_defaults_when_keys_absent() -> None:
    s = BlendSettings.from_mapping({"chunk_size": 256})
    assert s == BlendSettings()
    assert (s.enabled, s.special_str, s.check_layers, s.recompute_ratios, s.min_tokens) == (
        False, " # # ", (1,), (0.15,), 256,
    )
    assert set(BLEND_KEYS) == {
        "enable_blending", "blend_special_str", "blend_check_layers", "blend_recompute_ratios", "blend_min_tokens",
    }


def test_yaml_values() -> None:
    s = BlendSettings.from_mapping({
        "enable_blending": True, "blend_special_str": "<sep>", "blend_check_layers": [1, 4],
        "blend_recompute_ratios": [0.3, 0.1], "blend_min_tokens": 64,
    })
    assert s == BlendSettings(True, "<sep>", (1, 4), (0.3, 0.1), 64)


def test_env_strings() -> None:
    s = BlendSettings.from_mapping({
        "enable_blending": "True", "blend_check_layers": "2", "blend_recompute_ratios": "0.05",
        "blend_min_tokens": "128",
    }, source="env")
    assert s == BlendSettings(True, " # # ", (2,), (0.05,), 128)
    assert BlendSettings.from_mapping({"blend_check_layers": "[1, 3]"}).check_layers == (1, 3)


def test_single_ratio_applies_to_every_check_layer() -> None:
    s = BlendSettings.from_mapping({"blend_check_layers": [1, 2], "blend_recompute_ratios": [0.2]})
    assert s.recompute_ratios == (0.2, 0.2)


def test_recompute_counts_round_down() -> None:
    s = BlendSettings(recompute_ratios=(0.15,))
    assert s.recompute_counts(100) == (15,)
    assert s.recompute_counts(10) == (1,)
    assert BlendSettings(recompute_ratios=(1.0,)).recompute_counts(7) == (7,)
    assert BlendSettings(recompute_ratios=(0.0,)).recompute_counts(7) == (0,)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"blend_recompute_ratios": [1.5]}, "blend_recompute_ratios"),
        ({"blend_recompute_ratios": "abc"}, "blend_recompute_ratios"),
        ({"blend_recompute_ratios": [True]}, "blend_recompute_ratios"),
        ({"blend_recompute_ratios": [0.1, 0.3], "blend_check_layers": [1, 2]}, "must not increase"),
        ({"blend_recompute_ratios": [0.1, 0.05, 0.01], "blend_check_layers": [1, 2]}, "one ratio per check layer"),
        ({"blend_check_layers": [3, 1]}, "strictly increasing"),
        ({"blend_check_layers": [-1]}, "blend_check_layers"),
        ({"blend_check_layers": []}, "blend_check_layers"),
        ({"blend_min_tokens": -5}, "blend_min_tokens"),
        ({"blend_min_tokens": "many"}, "blend_min_tokens"),
        ({"enable_blending": "maybe"}, "enable_blending"),
        ({"blend_special_str": ""}, "blend_special_str"),
        ({"blend_thresholds": [0.5]}, "blend_thresholds"),
    ],
)
def test_bad_values_name_the_key(values: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        BlendSettings.from_mapping(values, source="lmcache.yaml")
    message = str(err.value)
    assert needle in message and "lmcache.yaml" in message and "\n" not in message


def test_check_layer_beyond_model_is_refused() -> None:
    s = BlendSettings(check_layers=(1, 30), recompute_ratios=(0.15, 0.15))
    s.check_model(32)
    with pytest.raises(BlendConfigError, match=r"layer 30 does not exist in m \(24 layers\)"):
        s.check_model(24, "m")
