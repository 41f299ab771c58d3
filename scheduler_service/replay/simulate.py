"""One executor's timeline replayed through the real scheduler core against the simulated
executor, on a simulated clock.

Requests arrive at their recorded times, with prompts rebuilt from their block digests (so they
share prefixes as the originals did), and end as they did: at their max_tokens, at an EOS the
simulated executor emits after as many outputs as the original had when it stopped, or by
their client's abort at its recorded time. The lane's loop is reproduced: up to pipeline_depth
plans on the wire, the next planned as soon as a result is applied.

While every plan so far equals the recorded one, plans are made at their recorded times and
take their recorded durations, so an unchanged configuration reproduces the recorded schedule
step for step; from the first plan that differs, the clock is the simulation's own and steps
take what the fitted StepCost says.

A trace recorded with speculative decoding replays with it (the recorded config's settings, the
simulated executor verifying the drafts). The recorded text is not in the trace, so the
synthetic outputs stand in for its repetitiveness: they repeat themselves every ECHO_PERIOD
tokens, which prompt lookup picks up, except at positions drawn at the rate at which the recording
rejected drafts (SyntheticModel). Drafts are then proposed and accepted about as often as they
were: the first draft of each verify at the recorded rate, later ones less often. With the draft
method, the simulated draft model guesses that echo everywhere past the first ECHO_PERIOD
tokens, so it is right at the same rate.

A trace recorded under --target-itl-ms replays under it: while the recorded plans are
followed, each is planned under the step token limit it recorded; after, and under another
target (replay_timeline's target_itl_s), under the limit a timer of the simulated steps' times
gives, as the lane's timer does.
"""

from __future__ import annotations

import heapq
import zlib
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_service.core.config import SchedulerConfig, SchedulingKnobs
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sim_executor import SimulatedExecutor, default_next_token
from scheduler_service.core.step_plan import StepOutput, StepPlan, StepUpdates
from scheduler_service.core.step_timer import StepTimer
from scheduler_service.replay.step_cost import StepCost
from scheduler_service.replay.trace_reader import (
    Signature,
    Timeline,
    TracedRequest,
    signature,
)

# The simulated model's EOS: default_next_token never yields it.
REPLAY_EOS = 2
# Synthetic token ids: one run of block_size per distinct block digest, then each request's own.
_FIRST_TOKEN = 10_000
# Tokens after which a replayed output repeats itself, when the recording speculated.
ECHO_PERIOD = 16
# The config's speculative decoding settings as a step trace records them.
_SPECULATION = ("speculative_method", "num_speculative_tokens", "speculative_max_batch")


@dataclass(slots=True)
class StepRecord:
    """One simulated step, as the pictures and summaries use it."""

    planned_s: float
    done_s: float
    signature: Signature
    prefill_tokens: int
    decode_tokens: int
    # After its result was applied:
    waiting: int
    running: int
    kv_used_blocks: int
    preemptions: int
    # Tokens the step computes, by tenant: prompt tokens and decodes, as the fair policy charges
    # them (core/fair_share.py).
    served: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class Replayed:
    address: str
    config: SchedulerConfig
    steps: list[StepRecord] = field(default_factory=list)
    arrival_s: dict[str, float] = field(default_factory=dict)
    first_token_s: dict[str, float] = field(default_factory=dict)
    finished_s: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    # Leading plans equal to the recorded ones.
    matched_steps: int = 0
    num_recorded_steps: int = 0
    # Seconds between a request's token and its previous one, one figure per request and step
    # (StepUpdates.inter_token_gaps).
    token_gaps: list[float] = field(default_factory=list)


def planned_step(scheduler: Scheduler, plan: StepPlan, planned_s: float, done_s: float) -> StepRecord:
    """The record of a plan just made; its queue and KV figures are filled in by
    record_result once its result is applied."""
    decoded = scheduler.decoded_in(plan)
    continuing = {c.request_id: c.num_scheduled_tokens for c in plan.continuing_requests}
    checkpoints = [(c.request_id, c.num_tokens, c.slot) for c in plan.state_checkpoints]
    sources = {n.request_id: n.state_source_slot for n in plan.new_requests if n.state_source_slot}
    shape = signature([n.request_id for n in plan.new_requests], continuing, [r.request_id for r in decoded], checkpoints, sources)
    prefill, decode = plan.prefill_and_decode_tokens()
    served = Counter(r.tenant for r in decoded)
    for entry in (*plan.new_requests, *plan.continuing_requests):
        served[scheduler.requests[entry.request_id].tenant] += entry.num_scheduled_tokens
    return StepRecord(planned_s, done_s, shape, prefill, decode, 0, 0, 0, 0, served)


def record_result(replayed: Replayed, scheduler: Scheduler, updates: StepUpdates, step: StepRecord, clock: float) -> None:
    """Notes first tokens and finishes at clock, token gaps, and the queues and KV use after the
    step."""
    replayed.token_gaps += updates.inter_token_gaps
    for update in updates.updates:
        request = update.request
        if update.new_token_ids:
            replayed.first_token_s.setdefault(request.request_id, clock)
        if update.finished:
            replayed.finished_s[request.request_id] = clock
            replayed.outputs[request.request_id] = request.num_tokens - request.num_prompt_tokens
    stats = scheduler.kv.stats()
    step.waiting, step.running = scheduler.num_waiting, len(scheduler.running)
    step.kv_used_blocks = stats.num_blocks - stats.num_free_blocks
    step.preemptions = scheduler.num_preemptions
    replayed.steps.append(step)


def config_of(timeline: Timeline) -> SchedulerConfig:
    recorded = timeline.config
    return SchedulerConfig(
        num_kv_blocks=recorded["num_kv_blocks"], block_size=recorded["block_size"],
        max_model_len=recorded["max_model_len"], max_num_seqs=recorded["max_num_seqs"],
        max_num_batched_tokens=recorded["max_num_batched_tokens"], policy=Policy(recorded["policy"]),
        mode=StepMode(recorded["mode"]), enable_chunked_prefill=recorded["enable_chunked_prefill"],
        enable_prefix_caching=recorded["enable_prefix_caching"], bulk_decodes=recorded["bulk_decodes"],
        block_copies=recorded.get("block_copies", False),
        # Traces from before hybrid models were served record none, and from before their
        # prefix caching no checkpoints.
        num_state_slots=recorded.get("num_state_slots", 0),
        state_checkpoint_blocks=recorded.get("state_checkpoint_blocks", 0),
        # Traces from before speculative decoding ran without it.
        **{name: recorded[name] for name in _SPECULATION if name in recorded},
    )


def replay_timeline(
    timeline: Timeline, knobs: SchedulingKnobs | None, cost: StepCost, target_itl_s: float | None = None
) -> Replayed:
    """target_itl_s: the scheduler's --target-itl-ms (in seconds) to replay under; None: as
    recorded."""
    config = config_of(timeline)
    if knobs is not None:
        config = knobs.applied_to(config)
    return _Simulation(timeline, config, cost, target_itl_s).run()


def recorded_target_itl_s(timeline: Timeline) -> float:
    """The --target-itl-ms a timeline was recorded under, in seconds (0: none)."""
    return float(timeline.config.get("target_itl_s", 0.0))


class _Simulation:
    def __init__(self, timeline: Timeline, config: SchedulerConfig, cost: StepCost, target_itl_s: float | None) -> None:
        self.timeline = timeline
        self.cost = cost
        self.depth = int(timeline.config.get("pipeline_depth", 2))
        recorded_target = recorded_target_itl_s(timeline)
        self.target_itl_s = recorded_target if target_itl_s is None else target_itl_s
        # Under the recorded target, the recorded plans' limits while they are followed (the
        # lane's timer saw times this trace does not hold exactly); the simulation's own timer,
        # as a lane's, otherwise.
        self._recorded_limits = self.target_itl_s == recorded_target
        self.step_timer = StepTimer()
        self.clock = 0.0
        self.scheduler = Scheduler(config, eos_token_ids=(REPLAY_EOS,), clock=lambda: self.clock)
        self.requests = rebuild_requests(list(timeline.requests.values()), config.block_size)
        model = SyntheticModel(list(timeline.requests.values()), self.requests, recorded_acceptance([timeline]))
        self.executor = SimulatedExecutor(
            config.num_kv_blocks, config.block_size, next_token=model.next_token, verify_kv=False,
            num_state_slots=config.num_state_slots, draft_token=model.draft_token,
        )
        # (time, order, kind, request): arrivals and aborts, in time order.
        self._events: list[tuple[float, int, str, Request]] = []
        by_id = {r.request_id: r for r in self.requests}
        for order, traced in enumerate(timeline.requests.values()):
            request = by_id[traced.request_id]
            heapq.heappush(self._events, (traced.arrival_s, order, "add", request))
            if traced.aborted_s is not None:
                heapq.heappush(self._events, (traced.aborted_s, order, "abort", request))
        self.result = Replayed(timeline.address, config, num_recorded_steps=len(timeline.plans))

    def run(self) -> Replayed:
        scheduler, recorded = self.scheduler, self.timeline.plans
        # (plan, output, done at, seconds the simulated executor spent on it, record).
        in_flight: deque[tuple[StepPlan, StepOutput, float, float, StepRecord]] = deque()
        in_sync, last_done = True, 0.0
        while True:
            while len(in_flight) < self.depth:
                index = self.result.matched_steps
                planned = recorded[index].planned_s if in_sync and index < len(recorded) else self.clock
                self._apply_events_before(max(planned, self.clock))
                self.clock = max(planned, self.clock)
                if in_sync and self._recorded_limits and index < len(recorded):
                    limit = recorded[index].step_token_limit
                else:
                    limit = self.step_timer.step_token_limit(self.target_itl_s)
                plan = scheduler.schedule(limit)
                if not plan.has_work and not plan.dropped_request_ids:
                    break
                step = planned_step(scheduler, plan, self.clock, 0.0)
                in_sync = in_sync and index < len(recorded) and step.signature == recorded[index].signature
                duration = recorded[index].duration_s if in_sync else self.cost.seconds(step.prefill_tokens, step.decode_tokens)
                last_done = step.done_s = max(self.clock, last_done) + duration
                if in_sync:
                    self.result.matched_steps += 1
                in_flight.append((plan, self.executor.execute(plan), last_done, duration, step))
            if not in_flight:
                if not self._events:
                    break
                self.clock = max(self.clock, self._events[0][0])
                self._apply_events_before(self.clock, inclusive=True)
                continue
            plan, output, done, duration, step = in_flight.popleft()
            if plan.num_scheduled_tokens:
                self.step_timer.observe(plan.num_scheduled_tokens, duration)
            self._apply_events_before(done)
            self.clock = max(self.clock, done)
            record_result(self.result, scheduler, scheduler.update(output), step, self.clock)
        return self.result

    def _apply_events_before(self, t: float, inclusive: bool = False) -> None:
        while self._events and (self._events[0][0] < t or (inclusive and self._events[0][0] <= t)):
            at, _, kind, request = heapq.heappop(self._events)
            if kind == "add":
                self.result.arrival_s[request.request_id] = at
                self.scheduler.add_request(request)
            elif not request.is_finished:
                self.scheduler.abort(request.request_id)
                self.result.finished_s[request.request_id] = at

def recorded_acceptance(timelines: Sequence[Timeline]) -> float:
    """Drafts accepted of drafts verified in the recording (0 without speculation)."""
    plans = [plan for timeline in timelines for plan in timeline.plans]
    drafts = sum(plan.draft_tokens for plan in plans)
    return sum(plan.accepted_tokens for plan in plans) / drafts if drafts else 0.0


class SyntheticModel:
    """The simulated executor's tokens: deterministic, and EOS where the original request
    stopped (EOS, a stop token or a stop string), after as many outputs as it had then. With an
    acceptance (a recording that speculated), an output past its first ECHO_PERIOD tokens repeats
    the token ECHO_PERIOD back at that share of its positions (drawn by position)."""

    def __init__(self, traced: Sequence[TracedRequest], rebuilt: Sequence[Request], acceptance: float = 0.0) -> None:
        self._eos_after = {r.request_id: r.outputs for r in traced if r.finish == "stop" and r.outputs > 0}
        self._prompt_len = {r.request_id: len(r.prompt_token_ids) for r in rebuilt}
        self._acceptance = acceptance

    def next_token(self, request_id: str, token_ids: Sequence[int]) -> int:
        produced = len(token_ids) - self._prompt_len[request_id] + 1
        if self._eos_after.get(request_id) == produced:
            return REPLAY_EOS
        if produced > ECHO_PERIOD and self._acceptance:
            draw = zlib.crc32(f"{request_id}:{len(token_ids)}".encode()) / 2**32
            if draw < self._acceptance:
                return token_ids[-ECHO_PERIOD]
        return default_next_token(request_id, token_ids)

    def draft_token(self, request_id: str, token_ids: Sequence[int]) -> int:
        """A simulated draft model's guess: the echo, where outputs echo."""
        produced = len(token_ids) - self._prompt_len[request_id] + 1
        return token_ids[-ECHO_PERIOD] if produced > ECHO_PERIOD else default_next_token(request_id, token_ids)


def rebuild_requests(traced: Sequence[TracedRequest], block_size: int) -> list[Request]:
    """Requests with synthetic prompts: each distinct block digest becomes one run of
    block_size token ids, so prompts share exactly the blocks the originals shared."""
    blocks: dict[str, list[int]] = {}
    next_id = _FIRST_TOKEN
    rebuilt = []
    prompts: dict[str, list[int]] = {}
    for order, original in enumerate(traced):
        prompt: list[int] = []
        for digest in original.block_digests:
            if digest not in blocks:
                blocks[digest] = list(range(next_id, next_id + block_size))
                next_id += block_size
            prompt += blocks[digest]
        length = original.prompt_tokens + original.prior_outputs
        first = prompts.get(original.fork_of)
        if first is not None and not original.prior_outputs and len(first) == length:
            # A later choice: its whole prompt is its first choice's, so that it forks as it did.
            prompt = list(first)
        else:
            own = length - len(prompt)
            prompt += list(range(next_id, next_id + own))
            next_id += own
        prompts[original.request_id] = prompt
        stops = original.finish == "stop" and original.outputs > 0
        sampling = SamplingParams(max_tokens=original.max_tokens, ignore_eos=not stops, temperature=0.0)
        request = Request(
            original.request_id, prompt, sampling, priority=original.priority, fork_of=original.fork_of,
            tenant=original.tenant, ttft_deadline_s=original.ttft_deadline_s, tpot_target_s=original.tpot_target_s,
        )
        request.arrival_index = order
        rebuilt.append(request)
    return rebuilt
