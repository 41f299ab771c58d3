"""The valid range of each sampling setting, defined once: the scheduler checks a client's
request against it and the executor checks every plan entry against it.

Pure Python, like protos/limits.py, so the scheduler's planning core may use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Range:
    low: float
    high: float
    # Whether `low` itself is outside (top_p > 0, repetition_penalty > 0).
    low_open: bool = False

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def describe(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


SAMPLING_RANGES: Mapping[str, Range] = {
    "temperature": Range(0, math.inf),
    "top_p": Range(0, 1, low_open=True),
    "min_p": Range(0, 1),
    "repetition_penalty": Range(0, math.inf, low_open=True),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
}


def range_problems(values: Mapping[str, float], prefix: str = "") -> list[str]:
    """One sentence per setting outside its range, e.g. 'top_p must be in (0, 1], got 1.5'
    ('sampling.top_p ...' with prefix 'sampling.'). Settings not in `values` are not checked."""
    problems = []
    for name, allowed in SAMPLING_RANGES.items():
        if name not in values:
            continue
        value = values[name]
        if not math.isfinite(value):
            problems.append(f"{prefix}{name} must be a finite number, got {value}")
        elif not allowed.contains(value):
            problems.append(f"{prefix}{name} must be {allowed.describe()}, got {value}")
    return problems


# OpenAI's bounds on a logit bias: -100 in effect bans a token, 100 all but forces it.
LOGIT_BIAS_RANGE = Range(-100, 100)


def vocab_problem(token_ids: Sequence[int], vocab_size: int, name: str) -> str | None:
    """A sentence naming `name`'s first token id outside the vocab, or None when all lie in it."""
    outside = [token for token in token_ids if not 0 <= token < vocab_size]
    return f"{name} names token {outside[0]}, outside the vocab [0, {vocab_size})" if outside else None


def logit_bias_problem(pairs: Sequence[tuple[int, float]], vocab_size: int, name: str) -> str | None:
    """What is wrong with (token id, bias) pairs, as a sentence naming them `name`; None when
    the ids are distinct and in the vocab and the biases finite and in range."""
    ids = [token for token, _ in pairs]
    outside = vocab_problem(ids, vocab_size, name)
    if outside is not None:
        return outside
    if len(set(ids)) != len(ids):
        return f"{name} names a token twice"
    bad = [bias for _, bias in pairs if not LOGIT_BIAS_RANGE.contains(bias)]
    if bad:
        return f"{name} values must be {LOGIT_BIAS_RANGE.describe()}, got {bad[0]}"
    return None
