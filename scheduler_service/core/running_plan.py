"""The running requests' part of a step: the steady decodes' blocks and tokens in bulk, every
other running request's next decode token or prefill chunk (the lowest-ranked preempted when a
block is wanted), drafts for the decodes, and a request retried after a failed step, alone.

A mixin of Scheduler (core/scheduler.py), kept apart as scheduler_moves.py is, so that
Scheduler.schedule reads as the order of a step's parts, each in a file of its own: this one,
the waiting requests' admission (admission.py) and the plan made of them (plan_builder.py).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from kv_manager import KVCacheManager
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.decode_set import BulkStep, DecodeSet
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.policy import pick_victim
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.request_queue import WaitingQueue
from scheduler_service.core.speculation import Drafts, Speculation
from scheduler_service.core.stop_checker import may_sample_more


@dataclass(slots=True)
class BulkPlan:
    """The steady decodes' part of a step being planned."""

    step: BulkStep | None = None
    block_handles: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Whether finding their blocks preempted anyone (then nobody is admitted this step).
    preempted: bool = False


NO_BULK = BulkPlan()


class RunningPlan:
    """What it uses of the Scheduler it is mixed into."""

    config: SchedulerConfig
    share: FairShare
    kv: KVCacheManager
    waiting: WaitingQueue
    running: list[Request]
    decodes: DecodeSet
    speculation: Speculation
    _retrying: dict[Request, None]
    _planning_bulk: BulkStep | None
    _allocate: Callable[..., list[int] | None]
    _preempt: Callable[..., None]
    # admission.py
    _admit_waiting: Callable[..., int]

    def _schedule_decodes(self, budget: int) -> tuple[BulkPlan, int]:
        """The steady decodes' part of the step: blocks for those whose next token needs one
        (preempting as for any running request), then one token each, in bulk."""
        block_size = self.config.block_size
        plan = BulkPlan()
        needing = self.decodes.needing_blocks()
        # Each needs one block for its next token: when the pool has them all, they are taken at
        # once, as one allocate_slots each would (the request after a block boundary, about one
        # decode in block_size, every step).
        appended = self.kv.append_block_each([request.request_id for request in needing]) if needing else None
        if appended is not None:
            self.decodes.add_cover_each(needing, block_size)
            plan.block_handles.extend(request.handle for request in needing)
            plan.block_ids.extend(appended)
            needing = []
        for request in needing:
            if request not in self.decodes:
                continue
            computed = request.num_computed_tokens
            ids, victims = self._preempt_until_allocated(
                request, partial(self.kv.allocate_slots, request.request_id, request.token_ids, computed, 1)
            )
            plan.preempted |= bool(victims)
            if ids is not None and request in self.decodes:
                self.decodes.add_cover(request, len(ids) * block_size)
                plan.block_handles.extend([request.handle] * len(ids))
                plan.block_ids.extend(ids)
        plan.step = self._planning_bulk = self.decodes.plan(budget)
        if plan.step is not None:
            budget -= len(plan.step.handles)
        return plan, budget

    def _preempt_until_allocated(
        self, request: Request, allocate: Callable[[], list[int] | None]
    ) -> tuple[list[int] | None, list[Request]]:
        """allocate's blocks for the request, preempting (with swap) the policy's victims until
        it succeeds or the request itself was the victim (None then); and who was preempted."""
        victims: list[Request] = []
        while (ids := allocate()) is None:
            victim = pick_victim(self.running, self.config.policy, self.share)
            self._preempt(victim, swap=True)
            victims.append(victim)
            if victim is request:
                break
        return ids, victims

    def _schedule_retry_alone(
        self,
        budget: int,
        scheduled: dict[Request, int],
        new_blocks: dict[str, list[int]],
        admitted: list[Request],
    ) -> bool:
        """Plans a step for a request retried after a failed step, and nothing else, if one is
        running or heads the waiting queue and fits; the other requests wait one step.

        Returns whether it preempted: then nobody is admitted this step, as after any
        preemption, or a retried request that preempted itself would be admitted straight back
        and starve the running requests whose blocks it needs."""
        if not self._retrying:
            return False
        running = next((r for r in self._retrying if r.status is RequestStatus.RUNNING), None)
        if running is not None:
            return self._schedule_running(budget, scheduled, new_blocks, True, True, only=running)[1]
        if self.waiting and self.waiting.peek().retry_alone:
            self._admit_waiting(budget, scheduled, admitted)
        return False

    def _schedule_running(
        self,
        budget: int,
        scheduled: dict[Request, int],
        new_blocks: dict[str, list[int]],
        prefill: bool,
        decode: bool,
        only: Request | None = None,
    ) -> tuple[int, bool]:
        preempted = False
        decodes = self.decodes
        if only is not None:
            candidates = [only]
        else:
            # Steady decodes are planned in bulk and skipped here: with nothing else running
            # (the usual step under load), the loop is not run at all.
            candidates = list(self.running) if len(self.running) > len(decodes) else []
        for request in candidates:
            if budget <= 0:
                break
            if request in decodes or request.status is not RequestStatus.RUNNING or request in scheduled or request.moving:
                continue
            if request.retry_alone and request is not only:
                continue
            if not (prefill if request.in_prefill else decode):
                continue
            if not request.in_prefill and not may_sample_more(request, self.config.max_seq_len):
                continue
            # Drafts in flight, or waiting a step to carry some (speculation.py).
            if request.num_pending_outputs and self.speculation.sits_out(request):
                continue
            # A grammar's next mask needs the token in flight: it follows the plan where the
            # executor takes that, else the request waits for its token.
            if request.grammar is not None and request.num_pending_outputs and not (
                self.config.late_bitmasks and request.num_pending_outputs == 1
            ):
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            ids, victims = self._preempt_until_allocated(request, partial(self._allocate, request, num_new))
            preempted |= bool(victims)
            for victim in victims:
                # A victim planned earlier in this step gives back its tokens and blocks.
                budget += scheduled.pop(victim, 0)
                new_blocks.pop(victim.request_id, None)
            if ids is not None:
                scheduled[request] = num_new
                new_blocks[request.request_id] = ids
                budget -= num_new
        return budget, preempted

    def _plan_drafts(
        self,
        budget: int,
        scheduled: dict[Request, int],
        new_blocks: dict[str, list[int]],
        drafted: dict[Request, Drafts],
    ) -> int:
        """Drafts for the step's decodes whose earlier steps have all answered, from the budget
        the running requests left, in blocks that are free (never preempting for them); see
        speculation.py for who gets how many."""
        if not self.speculation.allowed:
            return budget
        for request, num_new in scheduled.items():
            if budget <= 0:
                break
            if num_new != 1 or request.in_prefill or request.num_pending_outputs:
                continue
            drafts = self.speculation.drafts_for(request, budget)
            if drafts and (ids := self._allocate(request, 1 + len(drafts))) is not None:
                scheduled[request] += len(drafts)
                new_blocks[request.request_id] += ids
                drafted[request] = drafts
                budget -= len(drafts)
        return budget
