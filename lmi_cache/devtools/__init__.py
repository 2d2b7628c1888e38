"""Developer tools for tests and benchmarks (not used at serving time)."""
from __future__ import annotations
