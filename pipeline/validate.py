"""Checks of one config or request value: each raises ValueError("<field>: must be ..., got ...").

The config (pipeline.config), the speculation settings (pipeline.spec_settings) and the request
parameters (pipeline.params) share these, so the same mistake reads the same everywhere and the
front end can take the field name from the text before the colon. A value of the wrong type is
named by its type only: request values come from clients, and echoing an arbitrary string back
would put client text in logs and error bodies. Numbers must be finite: no setting or parameter
here means anything at infinity or NaN.
"""

from __future__ import annotations

import math
from typing import Any


def integer(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """An int (not a bool) in [lo, hi] (hi None: no upper bound)."""
    bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(  # noqa: TRY004 - the contract: ValueError naming the field
            f"{name}: must be an integer {bounds}, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}: must be an integer {bounds}, got {value}")


def number(name: str, value: Any, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> None:
    """A finite int or float (not a bool) in the interval lo..hi (a bound None: none that side;
    `lo_open`: lo itself excluded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(  # noqa: TRY004 - the contract: ValueError naming the field
            f"{name}: must be a number{_bounds(lo, hi, lo_open)}, got {type(value).__name__}")
    low_ok = lo is None or (value > lo if lo_open else value >= lo)
    if not math.isfinite(value) or not low_ok or (hi is not None and value > hi):
        raise ValueError(f"{name}: must be a finite number{_bounds(lo, hi, lo_open)}, "
                         f"got {value}")


def positive(name: str, value: Any) -> None:
    """A finite number > 0."""
    number(name, value, lo=0, lo_open=True)


def choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        shown = repr(value) if isinstance(value, str) and len(value) <= 40 else type(value).__name__
        raise ValueError(f"{name}: must be one of {', '.join(options)}, got {shown}")


def _bounds(lo: float | None, hi: float | None, lo_open: bool) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""
