"""Value checks shared by config, speculation settings and request params: each raises
ValueError("<field>: must be ..., got ...") (the front end reads the field before the colon).
A wrong type is named by its type only, so client text never reaches logs or error bodies."""

from __future__ import annotations

import math
from typing import Any


def integer(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(  # noqa: TRY004 - the contract: ValueError naming the field
            f"{name}: must be an integer {bounds}, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}: must be an integer {bounds}, got {value}")


def number(name: str, value: Any, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> None:
    """A finite int or float (not a bool); a bound None: none that side."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(  # noqa: TRY004 - the contract: ValueError naming the field
            f"{name}: must be a number{_bounds(lo, hi, lo_open)}, got {type(value).__name__}")
    low_ok = lo is None or (value > lo if lo_open else value >= lo)
    if not math.isfinite(value) or not low_ok or (hi is not None and value > hi):
        raise ValueError(f"{name}: must be a finite number{_bounds(lo, hi, lo_open)}, "
                         f"got {value}")


def positive(name: str, value: Any) -> None:
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
