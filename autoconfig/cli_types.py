"""Bounded click parameter types for the ``lmi-cache`` flags (the user's shell, before any planning).

click's FloatRange lets NaN through (every comparison with NaN is false) and
accepts inf and 1e308, which later overflow when turned into bytes. These types
refuse them at the flag, with click's usual one-line usage error and exit 2.
"""
from __future__ import annotations

import math
from typing import Any

import click

MAX_SIZE_GIB = float(1 << 20)  # 1 PiB per rank
MAX_PARALLEL_DEGREE = 1 << 12
MAX_MODEL_LEN = 1 << 40
MAX_CHUNK_TOKENS = 1 << 16


class FiniteFloat(click.ParamType):
    """A finite float in [low, high] (``low_open``: low itself excluded)."""

    name = "float"

    def __init__(self, low: float, high: float, *, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{str(value)[:40]!r} is not a number", param, ctx)
        above_low = number > self.low if self.low_open else number >= self.low
        if not math.isfinite(number) or not above_low or number > self.high:
            bracket = "(" if self.low_open else "["
            self.fail(f"{str(value)[:40]!r} is not a finite number in {bracket}{self.low:,g}, {self.high:,.0f}]",
                      param, ctx)
        return number


class TensorParallel(click.ParamType):
    """LMI's tensor_parallel_degree: a degree from 1 to MAX_PARALLEL_DEGREE, or ``max`` (every GPU)."""

    name = "integer|max"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip().lower()
        if text == "max":
            return text
        try:
            return str(PARALLEL_DEGREE.convert(text, param, ctx))  # type: ignore[arg-type]  # click parses text
        except click.BadParameter:
            self.fail(f"{str(value)[:40]!r} is not 'max' or an integer from 1 to {MAX_PARALLEL_DEGREE}", param, ctx)


SIZE_GIB = FiniteFloat(0, MAX_SIZE_GIB)
FRACTION = FiniteFloat(0, 1, low_open=True)
PARALLEL_DEGREE = click.IntRange(1, MAX_PARALLEL_DEGREE)
MODEL_LEN = click.IntRange(1, MAX_MODEL_LEN)
CHUNK_TOKENS = click.IntRange(1, MAX_CHUNK_TOKENS)
TP_DEGREE = TensorParallel()
