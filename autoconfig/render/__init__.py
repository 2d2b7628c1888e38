"""Renderers: a TierPlan -> LMCache YAML and vLLM arguments."""
from __future__ import annotations
