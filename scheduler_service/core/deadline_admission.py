"""Admission by deadline: a request with a TTFT deadline or a per-token target goes where the
step-cost model (core/ttft_forecast.py) predicts it meets them, and is refused at arrival when it
would meet them nowhere, with the predicted wait; a refused request costs its client one round
trip instead of a late answer, and costs the requests admitted nothing: one that would be served
before queued requests (an earlier deadline, its tenant's turn) goes only where none of them is
then predicted to miss its deadline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from scheduler_service.core.errors import AdmissionRefused, ErrorKind
from scheduler_service.core.policy import Policy
from scheduler_service.core.queue_forecast import QueueForecast, forecast_queue
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_timer import StepTimer
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


@dataclass(slots=True, frozen=True)
class Candidate:
    """An executor a request may go to."""

    scheduler: Scheduler
    # Its step time by tokens (its lane's StepTimer); None: too few steps seen to forecast.
    step_seconds: Callable[[float], float] | None
    # The step token limit its lane plans under now (--target-itl-ms), if any.
    step_token_limit: int | None = None

    @classmethod
    def of_lane(cls, scheduler: Scheduler, timer: StepTimer, target_itl_s: float) -> Candidate:
        """An executor's lane as a candidate: its scheduler, what its step timer tells, and the
        step token limit its target gives now."""
        return cls(scheduler, timer.seconds if timer.ready else None, timer.step_token_limit(target_itl_s))


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

    @staticmethod
    def judges(request: Request) -> bool:
        """Whether the request has targets to judge (choose() returns `preferred` for one that
        has none): callers build candidates, a step-time forecast per executor, only then."""
        return bool(request.ttft_deadline_s or request.tpot_target_s)

    def choose(self, request: Request, candidates: Sequence[Candidate], preferred: int, now: float) -> int:
        """The candidate to queue the request on: `preferred` (the router's) when it meets the
        request's targets there, else the one predicted to give its first token soonest among
        those that meet them. AdmissionRefused (OVERLOADED, with retry_after_s) when none does.
        Requests without targets, and executors with too few steps seen, are not judged."""
        if not self.judges(request):
            return preferred
        order = [preferred, *(i for i in range(len(candidates)) if i != preferred)]
        best: tuple[float, int, Forecast] | None = None
        # Where it would meet its own targets but make a request admitted before it late: its
        # forecast, and that request with its own.
        broken: tuple[Forecast, Request, float] | None = None
        for index in order:
            candidate = candidates[index]
            scheduler, step_seconds, limit = candidate.scheduler, candidate.step_seconds, candidate.step_token_limit
            if step_seconds is None:
                return index
            mean_output = self._mean_output(request)
            forecast = forecast_ttft(scheduler, request, step_seconds, mean_output, limit)
            late = None
            if self._meets(request, forecast, now) and self._may_pass(request, scheduler):
                queue = forecast_queue(scheduler, request, step_seconds, mean_output, limit)
                # The later of the two forecasts of its own first token counts.
                forecast = replace(forecast, ttft_s=max(forecast.ttft_s, queue.ttft_s[request]))
                late = self._late(queue, request, scheduler.config.policy, now)
            if self._meets(request, forecast, now):
                if late is None:
                    return index
                broken = broken or (forecast, *late)
            if best is None or forecast.ttft_s < best[0]:
                best = (forecast.ttft_s, index, forecast)
        assert best is not None, "no candidate executor"
        if broken is not None:
            raise self._overtaking_refusal(request, *broken, now)
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

    @staticmethod
    def _may_pass(request: Request, scheduler: Scheduler) -> bool:
        """Whether the whole queue must be simulated (core/queue_forecast.py), for a request with
        a TTFT deadline: under fair always (its turn moves as tenants are charged); under
        priority when it would be served before a queued request of its priority with a later
        deadline. Under FCFS it passes none, and forecast_ttft sees every request ahead of it."""
        if not request.ttft_deadline_s or scheduler.config.policy is Policy.FCFS:
            return False
        if scheduler.config.policy is Policy.FAIR:
            return True
        return any(
            q.priority == request.priority and q.first_token_time is None and q.ttft_deadline > request.ttft_deadline
            for q in scheduler.queued
            if q.ttft_deadline_s
        )

    def _late(self, queue: QueueForecast, request: Request, policy: Policy, now: float) -> tuple[Request, float] | None:
        """The first request it would be served before that would then miss its deadline (as
        admission judges one). One of a lower priority in the same queue (the whole queue under
        priority, its tenant's under fair) is not counted: priority may make it late."""
        for passed in queue.overtaken(request):
            outranked = passed.priority > request.priority and (policy is Policy.PRIORITY or passed.tenant == request.tenant)
            if not passed.ttft_deadline_s or passed.first_token_time is not None or outranked:
                continue
            if queue.ttft_s[passed] > self.margin * (passed.ttft_deadline - now):
                return passed, queue.ttft_s[passed]
        return None

    def _overtaking_refusal(
        self, request: Request, forecast: Forecast, late: Request, late_ttft_s: float, now: float
    ) -> AdmissionRefused:
        waited = now - request.arrival_time
        return AdmissionRefused(
            "deadline",
            ErrorKind.OVERLOADED,
            f"predicted time to first token {(waited + forecast.ttft_s) * 1000:.0f} ms meets the deadline "
            f"of {request.ttft_deadline_s * 1000:.0f} ms (ttft_deadline_ms), but served first it would make "
            f"a request admitted before it miss its own ({(now - late.arrival_time + late_ttft_s) * 1000:.0f} ms "
            f"to its first token against {late.ttft_deadline_s * 1000:.0f} ms); retry later",
            # Once that one has its first token this one passes nothing it could make late.
            max(0.1, late_ttft_s),
        )

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
