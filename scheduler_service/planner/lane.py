"""One executor behind the scheduler: its link, its planner (block pool and queues) and the loop
that keeps its plans flowing, at its own pace, with the next plan on the wire before the last
result returns.

A lane is reached (Describe, then an Execute stream opened with a handshake), checked by the
engine (same model, not an executor already served under another address), then driven until
its executor is lost, drained or refused. A result that does not come back within a deadline
derived from the lane's recent step times counts as lost, like a broken stream: an executor that
is alive but frozen is not waited for.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from protos.executor_access import INSECURE_ACCESS
from protos.splitserve.executor.v1 import executor_pb2
from scheduler_service.core.audit import audit_executor
from scheduler_service.core.config import DEFAULT_SPECULATIVE_MAX_BATCH, SchedulerConfig
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.core.prefill_share import MIN_PREFILL_TOKENS
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_plan import StepOutput, StepPlan, StepUpdates
from scheduler_service.core.step_timer import StepTimer
from scheduler_service.core.suffix_proposer import SuffixTable
from scheduler_service.planner.executor_link import (
    ExecutorLink,
    ExecutorLost,
    ExecutorRefused,
)
from scheduler_service.planner.lane_audit import (
    AuditAbandoned,
    ExecutorAudit,
    PendingAudits,
)
from scheduler_service.planner.plan_codec import (
    late_bitmasks_to_proto,
    output_from_proto,
    plan_to_proto,
)

logger = logging.getLogger(__name__)

RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
# A refused executor (another model, held by another scheduler) is asked again this often.
REFUSED_RETRY_S = 5.0
# Step times remembered for the result deadline.
STEP_TIME_WINDOW = 32
# A step result is waited for at most max(floor, factor x the slowest recent step). The floor
# covers the first steps (no history yet, CUDA warm-up, a long prefill).
DEFAULT_STEP_TIMEOUT_FLOOR_S = 30.0
DEFAULT_STEP_TIMEOUT_FACTOR = 10.0
# A hybrid model's recurrent state is kept every this many full blocks of a request's tokens
# (--state-checkpoint-blocks), for prefix hits to resume from.
DEFAULT_STATE_CHECKPOINT_BLOCKS = 4
# An idle lane sends an empty plan at least this often: it keeps this scheduler's hold (a third
# of the lease would do), and its answer is how an idle executor that got SIGTERM says it is
# draining, so the executor can stop within seconds instead of a third of its lease.
HEARTBEAT_MAX_S = 2.0
# While blocks are being fetched into its executor and nothing else is planned, a lane asks this
# often (an empty plan) whether they are written: the answer comes only with a result.
IMPORT_POLL_S = 0.005


class LaneState(enum.Enum):
    CONNECTING = "connecting"
    UP = "up"
    DRAINING = "draining"
    DRAINED = "drained"
    REFUSED = "refused"
    DOWN = "down"


@dataclass(slots=True, frozen=True)
class LaneOptions:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: Policy = Policy.FCFS
    mode: StepMode = StepMode.MIXED
    # Plans on the wire at once: 2 lets the executor start step N+1 as soon as step N ends.
    pipeline_depth: int = 2
    step_timeout_floor_s: float = DEFAULT_STEP_TIMEOUT_FLOOR_S
    step_timeout_factor: float = DEFAULT_STEP_TIMEOUT_FACTOR
    # For an executor of a hybrid model that supports checkpoints (SchedulerConfig).
    state_checkpoint_blocks: int = DEFAULT_STATE_CHECKPOINT_BLOCKS
    # Speculative decoding (core/speculation.py), for an executor that supports_draft_tokens:
    # the proposer, the most drafts per request and step (0: off), and the decode batch from
    # which steps carry none.
    speculative_method: str = "ngram"
    num_speculative_tokens: int = 0
    speculative_max_batch: int = DEFAULT_SPECULATIVE_MAX_BATCH
    # A step that carries decodes is planned to take about this long at most, by the
    # executor's step times so far (Scheduler.schedule's step_token_limit); 0: no such limit.
    target_itl_s: float = 0.0


def _speculates(options: LaneOptions, info: executor_pb2.ExecutorInfo) -> bool:
    """Whether the executor can verify what the options propose: drafts at all, and with the
    draft method a draft model of its own."""
    if options.speculative_method == "draft":
        return bool(info.draft_model)
    return info.supports_draft_tokens


class LaneHooks(Protocol):
    """What a lane asks of the engine that owns it."""

    # The fair policy's books, shared by every lane's scheduler.
    share: FairShare
    # Recent outputs of every lane's requests, for the suffix proposer (speculative decoding).
    suffixes: SuffixTable

    def refusal(self, lane: ExecutorLane, info: executor_pb2.ExecutorInfo) -> str | None: ...

    def lane_up(self, lane: ExecutorLane) -> None: ...

    def lane_lost(self, lane: ExecutorLane, reason: str) -> None: ...

    def lane_idle(self, lane: ExecutorLane) -> None: ...

    def lane_drained(self, lane: ExecutorLane) -> None: ...

    def executor_draining(self, lane: ExecutorLane) -> None: ...

    def plan_sent(self, lane: ExecutorLane, plan: StepPlan, planned_at: float) -> None: ...

    def lane_state_changed(self, lane: ExecutorLane) -> None: ...

    def deliver(self, lane: ExecutorLane, output: StepOutput, updates: StepUpdates) -> None: ...


class ExecutorLane:
    def __init__(
        self,
        address: str,
        link: ExecutorLink,
        options: LaneOptions,
        hooks: LaneHooks,
        extra_eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.address = address
        self.link = link
        self.options = options
        self.hooks = hooks
        # End-of-sequence ids beyond the executor's own (the tokenizer's).
        self.extra_eos_token_ids = extra_eos_token_ids
        self.state = LaneState.CONNECTING
        # Why it is down or refused, for status and logs.
        self.reason = ""
        self.info: executor_pb2.ExecutorInfo | None = None
        self.scheduler: Scheduler | None = None
        # Set when there may be work to plan (a request was placed, aborted or finished).
        self.wake = asyncio.Event()
        # Set by resume() while the lane waits drained.
        self.resumed = asyncio.Event()
        # Set to take the lane out for good (its executor left the service).
        self.retired = False
        # Set when the executor itself asked for the drain (it is shutting down): once drained,
        # the lane reaches for it again instead of waiting for an admin's resume, so a restarted
        # executor at the same address is taken back.
        self.rejoin_after_drain = False
        self._step_times: deque[float] = deque(maxlen=STEP_TIME_WINDOW)
        # The executor's step time by tokens, for deadline admission (core/ttft_forecast.py)
        # and the options' target_itl_s.
        self.step_timer = StepTimer()
        # Whether the log has said that the decodes alone fill target_itl_s (said once).
        self._target_missed = False
        # Steps with work this executor ran for us, over every connection.
        self.num_steps = 0
        self.audits = PendingAudits()

    @property
    def serving(self) -> bool:
        """Takes new requests."""
        return self.state is LaneState.UP

    def step_deadline_s(self) -> float:
        slowest = max(self._step_times, default=0.0)
        return max(self.options.step_timeout_floor_s, self.options.step_timeout_factor * slowest)

    def drain(self) -> None:
        if self.state is LaneState.UP:
            self._set_state(LaneState.DRAINING, "drain requested")
            self.wake.set()

    async def audit(self) -> ExecutorAudit:
        """Compares the executor's request states with this scheduler's books once no plan is
        on the wire (core/audit.py)."""
        if self.scheduler is None or self.state not in (LaneState.UP, LaneState.DRAINING):
            return ExecutorAudit(self.address, False, f"the executor is {self.state.value}", ())
        waiting = self.audits.ask()
        self.wake.set()
        try:
            mismatches = await waiting
        except AuditAbandoned as abandoned:
            return ExecutorAudit(self.address, False, str(abandoned), ())
        return ExecutorAudit(self.address, True, "", tuple(mismatches))

    def resume(self) -> None:
        if self.state is LaneState.DRAINING:
            self._set_state(LaneState.UP, "")
        elif self.state is LaneState.DRAINED:
            self.resumed.set()

    async def run(self) -> None:
        """Reaches, drives, and on loss reaches again, until retired."""
        while not self.retired:
            if self.state is LaneState.DRAINED and self.rejoin_after_drain:
                self.rejoin_after_drain = False
                self._set_state(LaneState.DOWN, "the executor drained for its shutdown")
            elif self.state is LaneState.DRAINED:
                await self.resumed.wait()
                self.resumed.clear()
                self._set_state(LaneState.CONNECTING, "resumed")
            await self._reach()
            try:
                await self._drive()
            except ExecutorLost as lost:
                self.link.close_stream()
                self.audits.abandon(f"the executor was lost before it answered: {lost}")
                self._set_state(LaneState.DOWN, str(lost))
                self.hooks.lane_lost(self, str(lost))
                self.scheduler = None

    async def _reach(self) -> None:
        """Until the executor answers, serves the same model, and lets this scheduler hold it."""
        delay = RETRY_MIN_S
        while True:
            try:
                info = await self.link.describe()
                refusal = self.hooks.refusal(self, info)
                if refusal is None:
                    await self.link.open_stream(handshake_timeout_s=self.options.step_timeout_floor_s)
                    # Asked again: another lane may have come up with another model while this
                    # one waited for its stream, and nothing awaits between here and lane_up.
                    refusal = self.hooks.refusal(self, info)
                    if refusal is not None:
                        self.link.close_stream()
            except ExecutorRefused as refused:
                refusal = str(refused)
            except ExecutorLost as lost:
                if self.state is not LaneState.DOWN or self.reason != str(lost):
                    self._set_state(self._unreachable_state(), str(lost))
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            if refusal is not None:
                if self.state is not LaneState.REFUSED or self.reason != refusal:
                    self._set_state(LaneState.REFUSED, refusal)
                await asyncio.sleep(REFUSED_RETRY_S)
                continue
            self.info = info
            if info.access == INSECURE_ACCESS:
                logger.warning(
                    "event=executor_insecure address=%s advice='anyone who reaches it can run plans "
                    "and read its KV: give it --executor-token-file or mutual TLS'",
                    self.address,
                )
            eos = frozenset(info.eos_token_ids) | self.extra_eos_token_ids
            self.scheduler = Scheduler(self._config(info), eos, share=self.hooks.share, suffixes=self.hooks.suffixes)
            if self.options.num_speculative_tokens and not _speculates(self.options, info):
                # Said once per connection: an operator who asked for speculation finds why it is off.
                logger.warning(
                    "event=speculation_off address=%s reason=%r",
                    self.address,
                    "the executor has no draft model (its --draft-model)"
                    if info.supports_draft_tokens
                    else "the executor does not verify draft tokens",
                )
            if info.num_state_slots:
                # Said once per connection: an operator wondering why this executor gets no
                # prefix hits, or runs fewer requests than max_num_seqs, finds it here.
                config = self.scheduler.config
                logger.info(
                    "event=executor_recurrent_state address=%s state_slots=%d state_slot_bytes=%d "
                    "supports_state_checkpoints=%s state_checkpoint_blocks=%d prefix_caching=%s forks=off",
                    self.address,
                    info.num_state_slots,
                    info.state_slot_bytes,
                    info.supports_state_checkpoints,
                    config.state_checkpoint_blocks,
                    "on" if config.enable_prefix_caching else "off",
                )
            self._step_times.clear()
            self.step_timer = StepTimer()
            self._set_state(LaneState.UP, "")
            self.hooks.lane_up(self)
            return

    def _unreachable_state(self) -> LaneState:
        return LaneState.DOWN if self.state in (LaneState.DOWN, LaneState.UP, LaneState.DRAINING) else LaneState.CONNECTING

    async def _drive(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None and self.info is not None
        # (sent at, tokens it computes) of each plan on the wire, oldest first.
        in_flight: deque[tuple[float, int]] = deque()
        # When the executor last answered: a pipelined step starts when the one before it ends.
        answered_at = 0.0
        heartbeat_s = min(HEARTBEAT_MAX_S, (self.info.lease_timeout_s or 30.0) / 3)
        while True:
            if self.state is LaneState.DRAINING and scheduler.load == 0 and not scheduler.num_exports and not in_flight:
                self.link.close_stream()
                self.audits.abandon("the executor drained before it answered")
                self._set_state(LaneState.DRAINED, "drained")
                self.scheduler = None
                self.hooks.lane_drained(self)
                return
            if self.state is LaneState.UP and scheduler.load == 0:
                self.hooks.lane_idle(self)
            while len(in_flight) < self.options.pipeline_depth and not self.audits.wanted:
                planned_at = time.monotonic()
                plan = scheduler.schedule(self.step_timer.step_token_limit(self.options.target_itl_s))
                if not plan.has_work and not plan.dropped_request_ids and not plan.has_moves:
                    break
                await self._send(plan, planned_at, in_flight)
            if self.audits.wanted and not in_flight:
                # Nothing on the wire: the executor's answer to this plan and the scheduler's
                # books after its result cover the same plans.
                planned_at = time.monotonic()
                plan = scheduler.schedule(self.step_timer.step_token_limit(self.options.target_itl_s))
                plan.want_held_requests = True
                await self._send(plan, planned_at, in_flight)
                self.audits.sent(plan.step_id)
            if not in_flight:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), IMPORT_POLL_S if scheduler.num_importing else heartbeat_s)
                except TimeoutError:
                    # Nothing to do for a while: an empty plan keeps this scheduler's hold.
                    planned_at = time.monotonic()
                    await self._send(scheduler.schedule(), planned_at, in_flight)
                continue
            result = await self.link.receive(self.step_deadline_s())
            sent_at, tokens = in_flight.popleft()
            now = time.monotonic()
            self._step_times.append(now - sent_at)
            if tokens:
                self.num_steps += 1
                self.step_timer.observe(tokens, now - max(sent_at, answered_at))
            answered_at = now
            output = output_from_proto(result)
            updates = scheduler.update(output)
            # First, as the executor may be waiting for them to sample.
            for late in updates.late_bitmasks:
                await self.link.send(late_bitmasks_to_proto(late))
            self.hooks.deliver(self, output, updates)
            if self.audits.answers(output.step_id):
                self.audits.answer(audit_executor(scheduler, output.held_requests or {}))
            if result.draining and self.state is LaneState.UP:
                self.rejoin_after_drain = True
                self.hooks.executor_draining(self)

    def _check_target(self, limit: int, decodes: int) -> None:
        """Logs, once, a step whose decodes alone are forecast past target_itl_s: every step
        then carries the least prefill, and long prompts wait long for their first token."""
        if decodes < limit:
            return
        self._target_missed = True
        logger.warning(
            "event=itl_target_missed address=%s target_itl_ms=%g decode_tokens=%d step_token_limit=%d "
            "reason=%r",
            self.address, self.options.target_itl_s * 1000, decodes, limit,
            "this executor's decodes alone take longer than --target-itl-ms: each step that decodes "
            f"gets {MIN_PREFILL_TOKENS} prefill tokens; raise the target or lower --max-num-seqs",
        )

    async def _send(self, plan: StepPlan, planned_at: float, in_flight: deque[tuple[float, int]]) -> None:
        assert self.scheduler is not None
        if plan.step_token_limit is not None and not self._target_missed:
            self._check_target(plan.step_token_limit, plan.prefill_and_decode_tokens()[1])
        self.hooks.plan_sent(self, plan, planned_at)
        await self.link.send(plan_to_proto(plan, self.scheduler.eos_token_ids))
        in_flight.append((time.monotonic(), plan.num_scheduled_tokens))

    def _config(self, info: executor_pb2.ExecutorInfo) -> SchedulerConfig:
        options = self.options
        return SchedulerConfig(
            num_kv_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            policy=options.policy,
            mode=options.mode,
            bulk_decodes=info.supports_decode_handles,
            late_bitmasks=info.supports_late_bitmasks,
            block_copies=info.supports_block_copies,
            num_state_slots=info.num_state_slots,
            # An older executor keeps no checkpoints: its hybrid model has no prefix caching.
            state_checkpoint_blocks=options.state_checkpoint_blocks if info.supports_state_checkpoints else 0,
            num_host_blocks=info.num_host_blocks,
            speculative_method=options.speculative_method,
            num_speculative_tokens=options.num_speculative_tokens if _speculates(options, info) else 0,
            speculative_max_batch=options.speculative_max_batch,
        )

    def _set_state(self, state: LaneState, reason: str) -> None:
        self.state, self.reason = state, reason
        self.hooks.lane_state_changed(self)
        logger.info(
            "event=executor_state address=%s state=%s reason=%r incarnation=%s",
            self.address,
            state.value,
            reason,
            self.info.incarnation_id if self.info else "",
        )
