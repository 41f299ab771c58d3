"""An executor's step time as it runs: seconds = overhead + per_token x tokens, fitted online
to the steps it ran (least squares, older steps forgotten geometrically), so a forecast follows
the executor's load and the machine it is on without a calibration run."""

from __future__ import annotations

from dataclasses import dataclass

# How much of the fit one step's weight keeps after another step: about the last 100 steps count.
DECAY = 0.99
# Steps seen before a forecast is trusted.
MIN_STEPS = 8


@dataclass(slots=True)
class StepTimer:
    steps_seen: int = 0
    _weight: float = 0.0
    _sum_x: float = 0.0
    _sum_y: float = 0.0
    _sum_xx: float = 0.0
    _sum_xy: float = 0.0

    @property
    def ready(self) -> bool:
        return self.steps_seen >= MIN_STEPS

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that computed `tokens` tokens took `seconds` of the executor's time."""
        self.steps_seen += 1
        self._weight = self._weight * DECAY + 1.0
        self._sum_x = self._sum_x * DECAY + tokens
        self._sum_y = self._sum_y * DECAY + seconds
        self._sum_xx = self._sum_xx * DECAY + tokens * tokens
        self._sum_xy = self._sum_xy * DECAY + tokens * seconds

    def seconds(self, tokens: float) -> float:
        """The predicted time of a step computing this many tokens (0 before any step)."""
        if not self._weight:
            return 0.0
        mean_x, mean_y, slope = self._fit()
        return max(0.0, mean_y + slope * (tokens - mean_x))

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may compute and still be predicted to take at most `seconds`
        (0 when even an empty step would take longer); None while the fit is not ready or tells
        no cost per token, as when every step seen had the same size."""
        if not self.ready:
            return None
        mean_x, mean_y, slope = self._fit()
        if slope <= 0.0:
            return None
        return max(0, int(mean_x + (seconds - mean_y) / slope))

    def step_token_limit(self, target_s: float) -> int | None:
        """The step token limit (Scheduler.schedule's) that a --target-itl-ms of target_s
        seconds gives now: None with no target (0), or while tokens_within cannot tell."""
        return self.tokens_within(target_s) if target_s else None

    def _fit(self) -> tuple[float, float, float]:
        """Mean tokens, mean seconds and seconds per token of the steps seen (weighted)."""
        mean_x, mean_y = self._sum_x / self._weight, self._sum_y / self._weight
        spread = self._sum_xx / self._weight - mean_x * mean_x
        # Steps all of one size tell no slope: the mean time is the best guess for any size.
        slope = max(0.0, (self._sum_xy / self._weight - mean_x * mean_y) / spread) if spread > 1e-9 else 0.0
        return mean_x, mean_y, slope
