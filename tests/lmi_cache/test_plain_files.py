"""The one bounded reader of user files and the one refuser of NaN/Infinity (fast tier)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from lmi_cache.plain_files import PlainFileError, read_text_file, refuse_json_constant, whole_number


def test_reads_text_up_to_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_text("a" * 100)
    assert read_text_file(str(path), 100) == "a" * 100


@pytest.mark.parametrize("case, kind, clause", [
    ("missing", "missing", "no such file"),
    ("directory", "directory", "is a directory"),
    ("too_large", "too_large", "larger than 1 KiB"),
    ("encoding", "encoding", "not UTF-8 text (bad byte at offset 2)"),
])
def test_each_failure_is_one_clause_with_its_kind(tmp_path: Path, case: str, kind: str, clause: str) -> None:
    path = tmp_path / "f"
    if case == "directory":
        path.mkdir()
    elif case == "too_large":
        path.write_bytes(b"x" * 1025)
    elif case == "encoding":
        path.write_bytes(b"ok\xff")
    with pytest.raises(PlainFileError) as info:
        read_text_file(str(path), 1024)
    assert info.value.kind == kind and clause in str(info.value) and "\n" not in str(info.value)


def test_an_unreadable_file_says_why(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root reads any mode; a dangling symlink inside a file path fails the same way
        path = tmp_path / "plain" / "child"
        (tmp_path / "plain").write_text("not a directory")
    else:
        path = tmp_path / "secret"
        path.write_text("x")
        path.chmod(0)
    with pytest.raises(PlainFileError) as info:
        read_text_file(str(path), 1024)
    assert info.value.kind == "unreadable" and str(info.value).startswith("cannot read (")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_json_constants_are_refused(literal: str) -> None:
    with pytest.raises(ValueError, match=f"JSON literal {literal} is not a number"):
        json.loads(f'{{"x": {literal}}}', parse_constant=refuse_json_constant)


@pytest.mark.parametrize("value, expected", [
    (4096, 4096), (4096.0, 4096), (-3, -3), (True, None), (False, None), (2.5, None),
    (math.nan, None), (math.inf, None), ("12", None), (None, None),
])
def test_whole_number(value: object, expected: int | None) -> None:
    assert whole_number(value) == expected
