"""argparse types for the services' numeric flags: a value that makes no sense is refused by
argparse itself (its usage and one `error:` line, exit 2), never by a traceback later on."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

MAX_PORT = 65535

Number = TypeVar("Number", int, float)


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _finite(text: str) -> float:
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return number


def _bounded(
    parse: Callable[[str], Number], accepts: Callable[[Number], bool], requirement: str
) -> Callable[[str], Number]:
    def flag_type(text: str) -> Number:
        number = parse(text)
        if not accepts(number):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return number

    return flag_type


# A TCP port, or 0 for any free one.
port_number = _bounded(_whole, lambda port: 0 <= port <= MAX_PORT, f"a port within 0..{MAX_PORT}")
positive_int = _bounded(_whole, lambda number: number >= 1, "at least 1")
non_negative_int = _bounded(_whole, lambda number: number >= 0, "0 or more")
positive_float = _bounded(_finite, lambda number: number > 0, "above 0")
non_negative_float = _bounded(_finite, lambda number: number >= 0, "0 or more")
# A share: above 0, at most all of it.
fraction = _bounded(_finite, lambda number: 0 < number <= 1, "above 0 and at most 1")
