"""autoconfig: probe -> plan -> render, run once at container start.

Never imports torch or vllm (container start must be fast and work without them).
"""
from __future__ import annotations
