"""Admission by deadline: a request with a TTFT deadline or a per-token target goes where the
step-cost model (core/ttft_forecast.py) predicts it meets them, and is refused at arrival when it
would meet them nowhere, with the predicted wait; a refused request costs its client one round
trip instead of a late answer, and costs the requests admitted nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler_service.core.errors import AdmissionRefused, ErrorKind
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.ttft_forecast import Forecast, forecast_ttft

# A forecast must fit in this share of the time left. Under overload the queue settles where
# admission starts refusing, so every request admitted is forecast near margin x its time left,
# and its wait varies about the forecast with the random ends of the requests ahead of it (in
# replays of heavy-tailed lengths, scheduler_service.replay --synthesize, a tenth of first tokens
# come over 1.5x their forecast): 0.6 keeps 95 % of them within their deadline where 0.8 kept
# 84-96 %. It costs an overloaded executor next to no throughput (its queue is only shorter) and
# an idle one none.
DEFAULT_MARGIN = 0.6
# How fast the mean output length follows finished requests.
_OUTPUT_SMOOTHING = 0.05

# A candidate executor: its scheduler, and its step time by tokens (None: too few steps seen to
# forecast).
Candidate = tuple[Scheduler, Callable[[float], float] | None]


@dataclass(slots=True)
class DeadlineAdmission:
    margin: float = DEFAULT_MARGIN
    # Mean output tokens of finished requests; None until one finished (then max_tokens is
    # assumed).
    mean_output: float | None = None

    def finished(self, request: Request) -> None:
        """Learns the output length of a request that ended by itself (not aborted). The mean
        starts from the first one's max_tokens, not its length: the first requests to end are the
        shortest of those started, and a mean taken from them would admit too many just when
        the queue is filling."""
        tokens = float(request.num_output_tokens)
        if self.mean_output is None:
            self.mean_output = float(request.sampling.max_tokens or tokens)
        self.mean_output += _OUTPUT_SMOOTHING * (tokens - self.mean_output)

    def choose(self, request: Request, candidates: Sequence[Candidate], preferred: int, now: float) -> int:
        """The candidate to queue the request on: `preferred` (the router's) when it meets the
        request's targets there, else the one predicted to give its first token soonest among
        those that meet them. AdmissionRefused (OVERLOADED, with retry_after_s) when none does.
        Requests without targets, and executors with too few steps seen, are not judged."""
        if not (request.ttft_deadline_s or request.tpot_target_s):
            return preferred
        order = [preferred, *(i for i in range(len(candidates)) if i != preferred)]
        best: tuple[float, int, Forecast] | None = None
        for index in order:
            scheduler, step_seconds = candidates[index]
            if step_seconds is None:
                return index
            forecast = forecast_ttft(scheduler, request, step_seconds, self._mean_output(request))
            if self._meets(request, forecast, now):
                return index
            if best is None or forecast.ttft_s < best[0]:
                best = (forecast.ttft_s, index, forecast)
        assert best is not None, "no candidate executor"
        raise self._refusal(request, best[2], now)

    def _mean_output(self, request: Request) -> float:
        if self.mean_output is not None:
            return self.mean_output
        return float(request.sampling.max_tokens or 0) or float("inf")

    def _meets(self, request: Request, forecast: Forecast, now: float) -> bool:
        if request.tpot_target_s and forecast.step_s > request.tpot_target_s:
            return False
        if request.ttft_deadline_s:
            return forecast.ttft_s <= self.margin * (request.ttft_deadline - now)
        return True

    def _refusal(self, request: Request, forecast: Forecast, now: float) -> AdmissionRefused:
        if request.tpot_target_s and forecast.step_s > request.tpot_target_s:
            return AdmissionRefused(
                "tpot",
                ErrorKind.OVERLOADED,
                f"predicted time per output token {forecast.step_s * 1000:.0f} ms exceeds the "
                f"target of {request.tpot_target_s * 1000:.0f} ms on every executor; retry later",
                max(1.0, forecast.ttft_s),
            )
        waited = now - request.arrival_time
        return AdmissionRefused(
            "deadline",
            ErrorKind.OVERLOADED,
            f"predicted time to first token {(waited + forecast.ttft_s) * 1000:.0f} ms would miss the "
            f"deadline of {request.ttft_deadline_s * 1000:.0f} ms (ttft_deadline_ms); retry later",
            max(0.1, forecast.ttft_s - self.margin * (request.ttft_deadline - now)),
        )
