"""argparse types for the commands' numeric flags.

A value out of range is refused as the flag is read (argparse names the flag: ``argument --output-len:
expected an integer > 0, got '0'``), never replaced by a default or left to fail later without the flag's
name. NaN is refused everywhere, and ``inf`` where the flag does not mean "without end".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive(kind: type[int] | type[float] = int, *, zero: bool = False,
             inf: bool = False) -> Callable[[str], int | float]:
    """An argparse ``type``: a ``kind`` above 0, finite.

    Args:
        zero: 0 is taken too (a flag whose 0 means none, or no limit).
        inf: ``inf`` is taken too (a request rate: everything at once).
    """
    wanted = f"{'an integer' if kind is int else 'a number'} {'>= 0' if zero else '> 0'}{' or inf' if inf else ''}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (value > 0 or (zero and value == 0)) or (math.isinf(value) and not inf):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


# requests per second, or inf: all at once
rate = positive(float, inf=True)


def rates(text: str) -> list[float]:
    """An argparse ``type``: request rates separated by commas, e.g. ``1,2,4,inf``."""
    return [rate(r) for r in text.split(",")]


def fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1) (a share that must leave something, e.g. ``--range-ratio``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value
