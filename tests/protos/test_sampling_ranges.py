"""Both ends check sampling settings against the one definition in protos/sampling_ranges.py:
for every setting, a value on each side of each bound is judged the same by the scheduler's
intake check and by the executor's plan validation."""

from __future__ import annotations

import math

import pytest

from executor_service.sampling.sampler_settings import SamplerSettings, sampling_problem
from protos.sampling_ranges import SAMPLING_RANGES
from protos.splitserve.executor.v1 import executor_pb2 as pb
from scheduler_service.core.sampling_params import SamplingParams


def _around_bounds(name: str) -> list[float]:
    allowed = SAMPLING_RANGES[name]
    values = [allowed.low - 0.5, allowed.low, allowed.low + 0.5, math.nan, math.inf]
    if allowed.high != math.inf:
        values += [allowed.high, allowed.high + 0.5]
    return values


@pytest.mark.parametrize("name", sorted(SAMPLING_RANGES))
def test_scheduler_and_executor_agree_on_every_range(name: str) -> None:
    for value in _around_bounds(name):
        scheduler_refuses = bool(SamplingParams(**{name: value}).problems(vocab_size=10, max_logprobs=5))
        config = pb.SamplerConfig(**{"temperature": 1.0, name: value})
        executor_refuses = sampling_problem(SamplerSettings.from_proto(config), max_logprobs=5, vocab_size=10) is not None
        # The proto's zero means "off" (top_p 1, no repetition penalty), which the executor
        # accepts; the scheduler's own record has no such zero.
        if value == 0 and name in ("top_p", "repetition_penalty"):
            assert scheduler_refuses and not executor_refuses
            continue
        assert scheduler_refuses == executor_refuses == (not SAMPLING_RANGES[name].contains(value)), value
