"""The two packages type-check: mypy is clean on lmi_cache and autoconfig (the seams are typed, no Any to hide in).

mypy runs once per session, started in the background at collection (``tests/conftest.py``: ``mypy_run``).
"""
from __future__ import annotations

import subprocess

import pytest


@pytest.mark.slow
def test_mypy_is_clean_on_both_packages(mypy_run: subprocess.CompletedProcess[str]) -> None:
    assert mypy_run.returncode == 0, mypy_run.stdout[-4000:] + mypy_run.stderr[-2000:]
    assert "Success: no issues found" in mypy_run.stdout
