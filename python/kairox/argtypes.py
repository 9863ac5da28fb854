"""Command-line value types shared by the subcommands: each parses one argument or raises
argparse.ArgumentTypeError with what was expected and what was given."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return n


def number_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = True) -> Callable[[str], float]:
    """A finite number in [lo, hi) by default; lo_open / hi_open choose each end's kind."""
    def parse(v: str) -> float:
        try:
            f = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {v!r}") from None
        inside = math.isfinite(f) and (lo < f if lo_open else lo <= f) and (f < hi if hi_open else f <= hi)
        if not inside:
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}"
                                             f"{')' if hi_open else ']'}, got {v}")
        return f
    return parse
