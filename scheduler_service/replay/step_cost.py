"""The simulated executor's step time, fitted to a trace's recorded steps:
seconds = overhead + per_prefill_token x prefill tokens + per_decode_token x decode tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler_service.replay.trace_reader import TracedPlan


@dataclass(slots=True, frozen=True)
class StepCost:
    overhead_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    # How well the fit explains the recorded steps it came from.
    mean_abs_error_pct: float
    r_squared: float
    num_steps: int

    def seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        return max(0.0, self.overhead_s + self.per_prefill_token_s * prefill_tokens + self.per_decode_token_s * decode_tokens)


def fit_step_cost(plans: Sequence[TracedPlan]) -> StepCost:
    """Least squares over the steps with work; a trace of fewer than three such steps gets its
    mean step time as the overhead."""
    steps = [p for p in plans if p.prefill_tokens + p.decode_tokens > 0 and p.duration_s > 0]
    if not steps:
        return StepCost(0.001, 0.0, 0.0, 0.0, 0.0, 0)
    seconds = np.array([p.duration_s for p in steps])
    if len(steps) < 3:
        return StepCost(float(seconds.mean()), 0.0, 0.0, 0.0, 0.0, len(steps))
    design = np.array([[1.0, p.prefill_tokens, p.decode_tokens] for p in steps])
    coefficients = _non_negative_fit(design, seconds)
    predicted = design @ coefficients
    residual = float(((seconds - predicted) ** 2).sum())
    spread = float(((seconds - seconds.mean()) ** 2).sum())
    error = float((np.abs(seconds - predicted) / seconds).mean() * 100)
    return StepCost(
        float(coefficients[0]), float(coefficients[1]), float(coefficients[2]),
        mean_abs_error_pct=error,
        r_squared=1.0 - residual / spread if spread > 0 else 1.0,
        num_steps=len(steps),
    )


def _non_negative_fit(design: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a token never makes a step faster): terms
    that come out negative are dropped and the rest refitted."""
    kept = list(range(design.shape[1]))
    while True:
        fitted, *_ = np.linalg.lstsq(design[:, kept], seconds, rcond=None)
        if (fitted >= 0).all() or len(kept) == 1:
            coefficients = np.zeros(design.shape[1])
            coefficients[kept] = np.maximum(fitted, 0.0)
            return coefficients
        kept.pop(int(np.argmin(fitted)))
