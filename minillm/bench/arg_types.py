"""argparse ``type=`` converters for the benchmark scripts: bad values are refused by argparse
itself, as one line ending in exit status 2, before anything is loaded or started."""

from __future__ import annotations

import argparse

from .workload import parse_lengths


def positive_int(text: str) -> int:
    """``text`` as an int >= 1. Raises argparse.ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def positive_float(text: str) -> float:
    """``text`` as a float > 0 (finite). Raises argparse.ArgumentTypeError otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def length_spec(text: str) -> str:
    """``text`` unchanged when :func:`minillm.bench.workload.parse_lengths` accepts it (the scripts
    pass the string on). Raises argparse.ArgumentTypeError with parse_lengths' message otherwise."""
    try:
        parse_lengths(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


