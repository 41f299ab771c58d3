"""A step's plan, made of what Scheduler.schedule chose: its new and continuing requests with their
blocks, masks and drafts, the bulk decodes, the executor's drops, block copies, K/V moves,
hybrid-model checkpoints and host-tier copies; and the scheduler's books of what the step has in
flight until its answer comes (step_results.py).

A mixin of Scheduler (core/scheduler.py), kept apart as scheduler_moves.py is, so that choosing
a step's work and writing it down as a plan each read in one file; it works on the scheduler's
own books.
"""

from collections.abc import Callable, Iterator

from kv_manager import BlockCopy, KVCacheManager
from scheduler_service.core.checkpoint_policy import CheckpointPolicy
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.decode_set import BulkStep, DecodeSet
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.handles import Handles
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import Request
from scheduler_service.core.running_plan import BulkPlan
from scheduler_service.core.speculation import Drafts, Speculation
from scheduler_service.core.step_plan import (
    ContinuingRequestPlan,
    NewRequestPlan,
    StepPlan,
)
from scheduler_service.core.step_results import InFlight
from scheduler_service.core.stop_checker import length_limit


class PlanBuilder:
    """What it uses of the Scheduler it is mixed into."""

    config: SchedulerConfig
    share: FairShare
    kv: KVCacheManager
    decodes: DecodeSet
    speculation: Speculation
    num_steps: int
    hand_off_after_prefill: bool
    _step_ids: Iterator[int]
    _on_executor: set[str]
    _to_drop: list[str]
    _copies: list[BlockCopy]
    _handles: Handles
    _checkpoints: CheckpointPolicy
    _planning_bulk: BulkStep | None
    _in_flight: dict[int, dict[str, InFlight]]
    _in_flight_bulk: dict[int, BulkStep]
    _late: dict[int, list[tuple[Request, int]]]
    # scheduler_moves.py
    _moves_into: Callable[[StepPlan], None]
    begin_move: Callable[[Request], None]

    def _build_plan(
        self,
        scheduled: dict[Request, int],
        new_blocks: dict[str, list[int]],
        admitted: list[Request],
        bulk: BulkPlan,
        drafted: dict[Request, Drafts] | None = None,
    ) -> StepPlan:
        plan = StepPlan(step_id=next(self._step_ids), dropped_request_ids=self._to_drop, block_copies=self._copies)
        self._to_drop, self._copies = [], []
        self._moves_into(plan)
        self._planning_bulk = None
        if bulk.step is not None:
            plan.decode_handles = bulk.step.handles
            plan.decode_block_handles, plan.decode_block_ids = bulk.block_handles, bulk.block_ids
            self._in_flight_bulk[plan.step_id] = bulk.step
        joining, handing = [], []
        fresh = set(admitted)
        in_flight: dict[str, InFlight] = {}
        late: list[tuple[Request, int]] = []
        # (request, tokens computed before, after) for the checkpoints a hybrid model keeps.
        spans: list[tuple[Request, int, int]] = []
        checkpointing = self._checkpoints.interval > 0
        fair = self.config.policy is Policy.FAIR
        if fair and bulk.step is not None:
            self.share.charge_all(self.decodes.live(bulk.step))
        for request, num_new in scheduled.items():
            drafts = drafted.get(request, Drafts()) if drafted else Drafts()
            samples = request.num_computed_tokens + num_new - len(drafts) == request.num_tokens + request.num_pending_outputs
            constrained = samples and request.grammar is not None
            follows = constrained and request.num_pending_outputs > 0
            if drafts.bitmasks:
                mask = drafts.bitmasks[0]
            else:
                mask = request.grammar.allowed_token_bitmask() if constrained and not follows else b""
            if follows:
                late.append((request, request.num_preemptions))
            if request in fresh:
                request.handle = self._handles.take()
                plan.new_requests.append(
                    NewRequestPlan(
                        request.request_id,
                        list(request.token_ids),
                        self.kv.block_ids(request.request_id),
                        request.num_computed_tokens,
                        num_new,
                        request.sampling,
                        request.num_prompt_tokens,
                        request.handle,
                        mask,
                        self.kv.state_slots.slot_of(request.request_id),
                        self._checkpoints.source_of(request.request_id),
                        # A hybrid request admitted with computed tokens and no checkpoint to
                        # read brought its state with it.
                        bool(request.num_computed_tokens)
                        and not self._checkpoints.source_of(request.request_id)
                        and bool(self.kv.state_slots.slot_of(request.request_id)),
                    )
                )
                self._on_executor.add(request.request_id)
            else:
                plan.continuing_requests.append(
                    ContinuingRequestPlan(
                        request.request_id,
                        num_new,
                        new_blocks[request.request_id],
                        mask,
                        follows,
                        list(drafts.token_ids),
                        drafts.from_model,
                        list(drafts.bitmasks[1:]),
                    )
                )
                if drafts:
                    self.speculation.sent(request)
                if fair:
                    self.share.charge(request.tenant, num_new)
            if checkpointing:
                spans.append((request, request.num_computed_tokens, request.num_computed_tokens + num_new))
            request.num_computed_tokens += num_new
            if samples:
                request.num_pending_outputs += 1
                if self.hand_off_after_prefill:
                    handing.append(request)
                elif self._decodes_in_bulk(request):
                    joining.append(request)
            in_flight[request.request_id] = InFlight(
                request, request.num_preemptions, request.num_computed_tokens, samples, drafts
            )
        if checkpointing and bulk.step is not None:
            spans += [(request, end - 1, end) for request, end in self.decodes.reaching(bulk.step, self._checkpoints.interval)]
        plan.state_checkpoints = self._checkpoints.plan(plan.step_id, spans)
        # Last: admissions and preemptions of this plan added to them.
        if self.kv.host is not None:
            copies = self.kv.take_tier_copies()
            plan.swap_out, plan.swap_in = copies.swap_out, copies.swap_in
        if in_flight:
            self._in_flight[plan.step_id] = in_flight
        if late:
            self._late[plan.step_id] = late
        for request in joining:
            cover = len(self.kv.block_ids(request.request_id)) * self.config.block_size
            self.decodes.join(request, request.handle, cover, length_limit(request, self.config.max_seq_len))
        for request in handing:
            self.begin_move(request)
        if plan.has_work:
            self.num_steps += 1
        return plan

    def _decodes_in_bulk(self, request: Request) -> bool:
        """Whether the request, its prefill done, decodes in bulk from now on: the executor
        supports it and nothing about the request needs per-request care (logprobs, stop token
        ids, min_tokens, a grammar's masks, an isolated retry, drafts)."""
        sampling = request.sampling
        return self.config.bulk_decodes and not (
            self.speculation.applies_to(request)
            or request.retry_alone
            or request.grammar is not None
            or sampling.logprobs is not None
            or sampling.stop_token_ids
            or sampling.min_tokens
        )
