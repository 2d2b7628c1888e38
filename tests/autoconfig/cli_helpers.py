"""Assertions on ``lmi-cache`` results shared by the CLI tests (the test process)."""
from __future__ import annotations

from click.testing import Result


def one_line_error(result: Result, *needles: str) -> str:
    """Exit 2 with exactly one ``lmi-cache: error:`` line on stderr holding every needle; no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmi-cache: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
