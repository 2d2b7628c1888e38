"""The LMCache YAML reader: duplicate keys name their lines, alias bombs stop in well under a second,
every extra_config finding is reported at once (files and LMCACHE_EXTRA_CONFIG alike)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from lmi_cache.config.cache_config import load_config
from lmi_cache.config.yaml_reader import MAX_EXPANDED_NODES, load_yaml
from lmi_cache.errors import ConfigError

BOMB = "".join(f"  {k}: &{k} [{', '.join([prev] * 9)}]\n" for k, prev in zip(
    "abcdefghi", ['"lol"'] + [f"*{c}" for c in "abcdefgh"]))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return str(path)


def test_a_duplicate_key_names_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nlocal_cpu: true\nchunk_size: 512\n")
    with pytest.raises(ConfigError, match=r"line 3: key 'chunk_size' is already set on line 1; keep one of them"):
        load_config(path, env={})


def test_a_duplicate_inside_extra_config_is_found_too(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nextra_config:\n  use_odirect: true\n  use_odirect: false\n")
    with pytest.raises(ConfigError, match="line 4: key 'use_odirect' is already set on line 3"):
        load_config(path, env={})


def test_merge_keys_and_same_key_in_other_mappings_are_not_duplicates() -> None:
    data = load_yaml("base: &b {x: 1}\nother:\n  <<: *b\n  x: 2\nthird: {x: 3}\n", "t.yaml")
    assert data["other"] == {"x": 2} and data["third"] == {"x": 3}


def test_an_alias_bomb_in_extra_config_stops_within_a_second(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nextra_config:\n" + BOMB + "  disk_feed: *i\n")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="alias bomb") as info:
        load_config(path, env={})
    assert time.monotonic() - start < 1.0
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_an_alias_bomb_in_lmcache_extra_config_stops_within_a_second() -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError, match="alias bomb"):
        load_config(None, env={"LMCACHE_EXTRA_CONFIG": "{" + BOMB.replace("\n", ", ").rstrip(", ") + "}"})
    assert time.monotonic() - start < 1.0


def test_modest_aliases_are_fine() -> None:
    data = load_yaml("a: &a [1, 2, 3]\nb: [*a, *a]\n", "t.yaml")
    assert data["b"] == [[1, 2, 3], [1, 2, 3]]
    wide = "a: [" + ", ".join(["1"] * (MAX_EXPANDED_NODES - 10)) + "]\n"
    assert len(load_yaml(wide, "t.yaml")["a"]) == MAX_EXPANDED_NODES - 10


def test_a_recursive_alias_is_one_line() -> None:
    with pytest.raises(ConfigError, match="contains it"):
        load_yaml("a: &a [1, *a]\n", "t.yaml")


def test_every_extra_config_finding_is_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nextra_config:\n  disk_feed: sideways\n  disk_write_workers: 0\n"
                           "  use_odirect: maybe\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert message.startswith("3 problems in extra_config: ")
    for key in ("disk_feed", "disk_write_workers", "use_odirect"):
        assert f"extra_config.{key}" in message
    assert "\n" not in message
