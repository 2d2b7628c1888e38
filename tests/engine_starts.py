"""The e2e tier's vLLM engine-start count, as one line at the end of a run (test process).

The e2e conftest counts starts in the process that ran the e2e tests; under pytest-xdist that is a
worker, which hands the count to the controller under ``ENGINE_STARTS_KEY`` (``tests/conftest.py`` prints it).
"""
from __future__ import annotations

ENGINE_STARTS_KEY = "lmi_cache_e2e_engine_starts"


def engine_starts_line(starts: dict[str, int]) -> str:
    detail = ", ".join(f"{name} {n}" for name, n in sorted(starts.items()))
    return f"e2e: {sum(starts.values())} vLLM engine starts ({detail})"
