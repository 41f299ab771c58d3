"""The step planner: which requests run this step, how many tokens each computes, which blocks
they use. The bookkeeping when the step's tokens come back is in step_results.py."""

import itertools
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kv_manager import (
    BlockCopy,
    BlockHash,
    KVCacheManager,
    PoolExhausted,
    PrefixHit,
    prefix_hash,
)
from scheduler_service.core.checkpoint_policy import CheckpointPolicy
from scheduler_service.core.config import SchedulerConfig, SchedulingKnobs
from scheduler_service.core.decode_set import BulkStep, DecodeSet
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.handles import Handles
from scheduler_service.core.length_limits import (
    check_room_in_cache,
    check_room_under_model_length,
)
from scheduler_service.core.move_books import (
    MoveBooks,
)
from scheduler_service.core.policy import Policy, StepMode, pick_victim, preempts
from scheduler_service.core.prefill_share import prefill_within
from scheduler_service.core.prefix_tracker import PrefixTracker
from scheduler_service.core.request import FinishReason, Request, RequestStatus
from scheduler_service.core.request_queue import WaitingQueue
from scheduler_service.core.scheduler_moves import RequestMoves
from scheduler_service.core.speculation import Drafts, Speculation
from scheduler_service.core.step_plan import (
    ContinuingRequestPlan,
    NewRequestPlan,
    StepPlan,
)
from scheduler_service.core.step_results import InFlight, StepResults
from scheduler_service.core.stop_checker import (
    length_limit,
    may_sample_more,
)
from scheduler_service.core.suffix_proposer import SuffixTable


@dataclass(slots=True)
class _BulkPlan:
    """The steady decodes' part of a step being planned."""

    step: BulkStep | None = None
    block_handles: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Whether finding their blocks preempted anyone (then nobody is admitted this step).
    preempted: bool = False


_NO_BULK = _BulkPlan()


class _AwaitFork:
    """A forking request's source has yet to write the prompt it shares (see _fork_source)."""


_AWAIT_FORK = _AwaitFork()


class Scheduler(RequestMoves, StepResults):
    """Owns the waiting and running queues and the KV block pool of one executor; its side of
    K/V moves and host-tier swaps is in scheduler_moves.py, how it takes in a step's answer in
    step_results.py."""

    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Collection[int] = (),
        clock: Callable[[], float] = time.monotonic,
        share: FairShare | None = None,
        suffixes: SuffixTable | None = None,
    ) -> None:
        self.config = config
        # The fair policy's books: the engine's, shared by every executor's scheduler, or this
        # scheduler's own.
        self.share = share if share is not None else FairShare()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.kv, self._checkpoints = self._new_books()
        self.waiting = WaitingQueue(config.policy, self.share)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self._arrivals = itertools.count()
        self._step_ids = itertools.count(1)
        # Requests the executor holds state for, and those to tell it to drop in the next plan.
        self._on_executor: set[str] = set()
        self._to_drop: list[str] = []
        # step id -> request id -> what that step does for the request, until its result is in.
        self._in_flight: dict[int, dict[str, InFlight]] = {}
        # Requests with retry_alone set, in the order their steps failed (a dict keeps the order
        # and, unlike scanning `running`, costs nothing per step while no step has failed).
        self._retrying: dict[Request, None] = {}
        # Prefix blocks of the requests placed here, and of those computing them now.
        self._prefixes = PrefixTracker()
        # Waiting requests held back until a prefix block they share with a running request is
        # cached (see _admit_waiting); they rejoin the queue in arrival order.
        self._deferred: list[Request] = []
        # Running requests in steady decode, planned and updated in bulk (see decode_set).
        self.decodes = DecodeSet(config.block_size, self.eos_token_ids)
        # step id -> that step's bulk decodes, until its result is in.
        self._in_flight_bulk: dict[int, BulkStep] = {}
        # step id -> (request, epoch) of its entries whose bitmask follows the plan, in step
        # order, until the bitmasks go (see _late_bitmasks).
        self._late: dict[int, list[tuple[Request, int]]] = {}
        self._handles = Handles(self._held_handles)
        # Block copies for the plan being made (forks' partial blocks).
        self._copies: list[BlockCopy] = []
        # K/V moving to and from this executor (move_books).
        self._moves = MoveBooks()
        # Set on a prefill executor while a decode executor can take its requests: a request
        # leaves once its first token is sampled.
        self.hand_off_after_prefill = False
        # Tokens computed again, by why their K/V was lost (Request.lose_kv), since start.
        self.recomputed_tokens: Counter[str] = Counter()
        # Preemptions that swapped the request's K/V to the host tier, since start.
        self.num_swapped_out = 0
        # The bulk decodes of the plan being made, once planned (a request swapped out after
        # that takes its part back).
        self._planning_bulk: BulkStep | None = None
        # step id -> (position in its decode_handles, request, epoch) of steady decodes swapped
        # out while that step was in flight: their tokens still count.
        self._kept_bulk: dict[int, list[tuple[int, Request, int]]] = {}
        # Drafts for running decodes; suffixes: the engine's table of recent outputs, shared by
        # every executor's scheduler, for the suffix proposer.
        self.speculation = Speculation(config, suffixes)

    @property
    def on_executor(self) -> frozenset[str]:
        """Requests whose state the executor holds, once the plans sent so far have run."""
        return frozenset(self._on_executor)

    @property
    def pending_drops(self) -> frozenset[str]:
        """Requests the next plan tells the executor to drop (it may still hold them)."""
        return frozenset(self._to_drop)

    def decoded_in(self, plan: StepPlan) -> list[Request]:
        """The steady decodes of a plan still in flight, in its decode_handles order."""
        bulk = self._in_flight_bulk.get(plan.step_id)
        return self.decodes.live(bulk) if bulk is not None else []

    def reconfigure(self, knobs: SchedulingKnobs) -> None:
        """Plans from the next step on under these knobs; the queue is reordered at once."""
        if knobs.policy is not self.config.policy:
            self.waiting = self.waiting.reordered(knobs.policy)
        self.config = knobs.applied_to(self.config)

    # ---- arrivals and departures -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(ErrorKind.DUPLICATE, f"request id {request.request_id!r} is already in flight")
        if not request.prompt_token_ids:
            raise RequestRejected(ErrorKind.INVALID, "the prompt is empty")
        check_room_under_model_length(request.num_prompt_tokens, self.config.max_model_len)
        check_room_in_cache(
            request.num_prompt_tokens,
            self.config.max_seq_len,
            f"a KV cache of {self.config.num_kv_blocks} blocks x {self.config.block_size} tokens",
        )
        if request.arrival_index < 0:
            request.arrival_index = next(self._arrivals)
        request.arrival_time = request.arrival_time or self.clock()
        self._place(request)
        self.share.join(request)
        self.waiting.add(request)

    def adopt(self, request: Request) -> bool:
        """Queues a request that waited or ran on another executor (lost, draining or busier),
        in its arrival order, with the tokens it has. A request too long for this executor is
        finished with LENGTH instead; returns whether it was queued."""
        self._place(request)
        self.share.join(request)
        if request.num_tokens >= self.config.max_seq_len:
            self.finish(request, FinishReason.LENGTH)
            return False
        if request.retry_alone:
            self._retrying[request] = None
        self.waiting.insert(request)
        return True

    @property
    def num_waiting(self) -> int:
        """Requests queued here, held back ones included."""
        return len(self.waiting) + len(self._deferred)

    def evict_all(self) -> list[Request]:
        """Lets go of every request, in arrival order, because the executor is gone: running
        ones lose their blocks and computed tokens (they will be recomputed elsewhere) and
        count a preemption (so results still in flight for them are stale) and an executor
        loss."""
        self.decodes.clear()
        self._in_flight_bulk.clear()
        evicted = sorted(self.requests.values(), key=lambda r: r.arrival_index)
        for request in evicted:
            if request.status is RequestStatus.RUNNING:
                request.num_preemptions += 1
                request.num_executor_losses += 1
                self.num_preemptions += 1
            request.status = RequestStatus.WAITING
            request.num_pending_outputs = 0
            request.moving = False
            request.lose_kv("executor_lost")
            self._unplace(request)
        self.running.clear()
        self.waiting.clear()
        self._deferred.clear()
        self._prefixes.clear()
        self._on_executor.clear()
        self._to_drop = []
        self._in_flight.clear()
        self._late.clear()
        self._retrying.clear()
        self._moves = MoveBooks()
        self._kept_bulk.clear()
        self.kv, self._checkpoints = self._new_books()
        return evicted

    def _new_books(self) -> tuple[KVCacheManager, CheckpointPolicy]:
        """Empty books: every block and state slot free, no checkpoint kept."""
        config = self.config
        kv = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching, config.num_state_slots, config.num_host_blocks
        )
        return kv, CheckpointPolicy(kv, config.state_checkpoint_tokens, self.prefix_hashes)

    def release_waiting(self, requests: Iterable[Request]) -> list[Request]:
        """Lets go of these waiting requests, for another executor to run them (work
        stealing, draining); returns them in arrival order."""
        released = sorted(requests, key=lambda r: r.arrival_index)
        for request in released:
            if request.status is not RequestStatus.WAITING or not self._unqueue(request):
                raise ValueError(f"request {request.request_id} is not waiting here")
            # One that arrived with its K/V leaves it behind.
            self.kv.free(request.request_id)
            request.lose_kv("released")
            self._unplace(request)
        return released

    @property
    def queued(self) -> list[Request]:
        """Waiting requests in admission order, held back ones last."""
        return [*self.waiting, *self._deferred]

    def affinity(self, request: Request) -> int:
        """Leading tokens of the request whose KV this executor's cache holds, or will hold
        once the requests already placed on it are computed (exact: the scheduler hands out
        every block)."""
        matched = 0
        # A hybrid model's request resumes only where recurrent state is kept: at a ready
        # checkpoint, or at a checkpoint boundary of blocks still being computed (where one is
        # kept as they are).
        hybrid, interval = self.config.num_state_slots > 0, self.config.state_checkpoint_blocks
        resumable = 0
        for block_hash in self.prefix_hashes(request):
            placed = block_hash in self._prefixes.placed
            if not placed and not self.kv.is_cached(block_hash):
                break
            matched += 1
            if hybrid and (self.kv.checkpoints.slot(block_hash) or (placed and interval and matched % interval == 0)):
                resumable = matched
        return (resumable if hybrid else matched) * self.config.block_size

    def prefix_hashes(self, request: Request) -> list[BlockHash]:
        """The request's prefix block hashes for this executor's block size, hashed once and
        extended as it gains tokens."""
        block_size = self.config.block_size
        if request.prefix_hashes_block_size != block_size:
            request.prefix_hashes, request.prefix_hashes_block_size = [], block_size
        hashes = prefix_hash.prefix_hashes(request.token_ids, block_size, request.cache_salt, request.prefix_hashes)
        if len(hashes) > len(request.prefix_hashes):
            request.prefix_hashes = hashes
        return hashes

    @property
    def load(self) -> int:
        """Requests placed on this executor."""
        return len(self.requests)

    def _place(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_pending_outputs = 0
        self.requests[request.request_id] = request
        if self.config.enable_prefix_caching:
            self._prefixes.placed.add(request, self.prefix_hashes(request))

    def _unplace(self, request: Request) -> None:
        del self.requests[request.request_id]
        self._prefixes.leave(request)
        self.speculation.leave(request)

    def _unqueue(self, request: Request) -> bool:
        """Takes a waiting request out of the queue (or the held-back list)."""
        if request in self._deferred:
            self._deferred.remove(request)
            return True
        return self.waiting.remove(request)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, FinishReason.ABORT)
        return True

    def stop_at_string(self, request: Request, stop_string: str, num_after_stop: int = 0) -> None:
        """Ends a request whose text reached a stop string (the service layer detects those in
        the detokenized text): the stop string is the reason even when the same tokens also
        ended it another way (EOS, length).

        num_after_stop: how many of its last tokens came after the one that completed the stop
        string (drafts accepted in the same step). They are dropped, so that its output and
        usage are those of decoding one token at a time, which would never have sampled them."""
        del request.token_ids[len(request.token_ids) - num_after_stop :]
        if request.is_finished:
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop_string
        else:
            self.finish(request, FinishReason.STOP, stop_string)

    def finish(self, request: Request, reason: FinishReason, stop_reason: str | None = None) -> None:
        """Ends a request: its blocks are freed and the executor is told to drop it."""
        if request.status is RequestStatus.WAITING:
            if not self._unqueue(request):
                self._cancel_import(request)
        elif request.status is RequestStatus.RUNNING:
            self._stop_moving(request)
            if request in self.decodes:
                self.decodes.leave(request)
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.finish_time = self.clock()
        request.num_pending_outputs = 0
        self.kv.free(request.request_id)
        self._forget_on_executor(request.request_id)
        self._retrying.pop(request, None)
        self._unplace(request)
        self.share.leave(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- planning ----------------------------------------------------------------------------

    def schedule(self, step_token_limit: int | None = None) -> StepPlan:
        """Plans the next step under max_num_batched_tokens tokens and max_num_seqs requests.

        In order:

        0. A request retried after a failed step (Request.retry_alone) runs alone: if one is
           running, or heads the waiting queue and fits, the step is its and no one else's.
        1. By mode:
           - mixed (default): every running request gets its next decode token or prefill
             chunk, in rank order; then waiting requests are admitted from the head of the queue
             while budget, sequences and blocks allow (prefix-cache hits count as computed, a
             prompt longer than the budget is chunked).
           - prefill-first: running prefills continue, then waiting requests are admitted; only
             a step with no prefill work at all runs the running requests' decodes.
           - decode-first: running requests (decodes and unfinished prefills) go first; waiting
             requests are admitted only when nothing was running.
        2. When a running request needs a block and none is free, the lowest-ranked running
           request is preempted (recompute: its blocks go, its tokens stay, it waits at the
           head) until the block fits or the request itself was the victim. A step that
           preempted admits no one, so freed blocks go to the running requests first.

        Admission stops at the first waiting request that does not fit, so no later request
        overtakes it. The plan is a diff (see step_plan); requests preempted or finished since
        the last plan are listed for the executor to drop.

        step_token_limit (mixed mode; the lane's --target-itl-ms as its step timer reads it):
        a step that carries decodes is held to about that many tokens. The decodes (and their
        drafts) are planned first, then prefill chunks and admissions share what the limit
        leaves, at least MIN_PREFILL_TOKENS (core/prefill_share.py), so that a long prompt's
        prefill is spread over several steps instead of stalling every decoding stream for one
        long step.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        new_blocks: dict[str, list[int]] = {}
        admitted: list[Request] = []
        drafted: dict[Request, Drafts] = {}
        if self._deferred:
            self._release_deferred()
        preempted = self._schedule_retry_alone(budget, scheduled, new_blocks, admitted)
        if scheduled:
            return self._build_plan(scheduled, new_blocks, admitted, _NO_BULK)
        self.speculation.begin_step(self.running)
        bulk = _NO_BULK
        mode = self.config.mode
        if mode is StepMode.MIXED:
            # Under a step token limit, running prefills wait until the decodes' share is known.
            bulk, budget = self._schedule_decodes(budget)
            budget, running_preempted = self._schedule_running(
                budget, scheduled, new_blocks, prefill=step_token_limit is None, decode=True
            )
            budget = self._plan_drafts(budget, scheduled, new_blocks, drafted)
            if step_token_limit is not None:
                decoding = sum(scheduled.values()) + (len(bulk.step.handles) if bulk.step is not None else 0)
                budget = prefill_within(budget, decoding, step_token_limit)
                budget, prefill_preempted = self._schedule_running(budget, scheduled, new_blocks, prefill=True, decode=False)
                running_preempted = running_preempted or prefill_preempted
            if not (preempted or bulk.preempted or running_preempted):
                budget = self._admit_waiting(budget, scheduled, admitted, bulk)
        elif mode is StepMode.PREFILL_FIRST:
            budget, running_preempted = self._schedule_running(budget, scheduled, new_blocks, prefill=True, decode=False)
            if not (preempted or running_preempted):
                budget = self._admit_waiting(budget, scheduled, admitted)
            if not scheduled:
                bulk, budget = self._schedule_decodes(budget)
                budget = self._schedule_running(budget, scheduled, new_blocks, prefill=False, decode=True)[0]
                self._plan_drafts(budget, scheduled, new_blocks, drafted)
        else:
            was_idle = not self.running
            bulk, budget = self._schedule_decodes(budget)
            budget = self._schedule_running(budget, scheduled, new_blocks, prefill=True, decode=True)[0]
            budget = self._plan_drafts(budget, scheduled, new_blocks, drafted)
            if was_idle and not preempted:
                self._admit_waiting(budget, scheduled, admitted, bulk)
        plan = self._build_plan(scheduled, new_blocks, admitted, bulk, drafted)
        if mode is StepMode.MIXED:
            plan.step_token_limit = step_token_limit
        return plan

    def _schedule_decodes(self, budget: int) -> tuple["_BulkPlan", int]:
        """The steady decodes' part of the step: blocks for those whose next token needs one
        (preempting as for any running request), then one token each, in bulk."""
        block_size = self.config.block_size
        plan = _BulkPlan()
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
            while (ids := self.kv.allocate_slots(request.request_id, request.token_ids, computed, 1)) is None:
                victim = pick_victim(self.running, self.config.policy, self.share)
                self._preempt(victim, swap=True)
                plan.preempted = True
                if victim is request:
                    break
            if ids is not None and request in self.decodes:
                self.decodes.add_cover(request, len(ids) * block_size)
                plan.block_handles.extend([request.handle] * len(ids))
                plan.block_ids.extend(ids)
        plan.step = self._planning_bulk = self.decodes.plan(budget)
        if plan.step is not None:
            budget -= len(plan.step.handles)
        return plan, budget

    def _release_deferred(self) -> None:
        """Requeues held-back requests whose next prefix block is no longer being computed
        (it is cached now, or whoever computed it left)."""
        still = []
        for request in self._deferred:
            if request.fork_of:
                if self._fork_source(request) is _AWAIT_FORK:
                    still.append(request)
                else:
                    self.waiting.insert(request)
                continue
            hashes = self.prefix_hashes(request)
            cached = next(
                (i for i, h in enumerate(hashes) if not self.kv.is_cached(h)), len(hashes)
            )
            if cached < len(hashes) and hashes[cached] in self._prefixes.computing:
                still.append(request)
            else:
                self.waiting.insert(request)
        self._deferred = still

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
            while (ids := self._allocate(request, num_new)) is None:
                victim = pick_victim(self.running, self.config.policy, self.share)
                budget += scheduled.pop(victim, 0)
                new_blocks.pop(victim.request_id, None)
                self._preempt(victim, swap=True)
                preempted = True
                if victim is request:
                    break
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

    def _admit_waiting(
        self,
        budget: int,
        scheduled: dict[Request, int],
        admitted: list[Request],
        bulk: _BulkPlan = _NO_BULK,
    ) -> int:
        budget = self._admit_queue(budget, scheduled, admitted, bulk)
        if not scheduled and bulk.step is None and not self.running and self.waiting and self._release_held():
            # Nothing runs to free what the head of the queue waits for, and waiting requests
            # that arrived with their K/V hold it: they give it up, and the head is tried again.
            budget = self._admit_queue(budget, scheduled, admitted, bulk)
        return budget

    def _admit_queue(
        self,
        budget: int,
        scheduled: dict[Request, int],
        admitted: list[Request],
        bulk: _BulkPlan,
    ) -> int:
        while self.waiting and budget > 0:
            request = self.waiting.peek()
            # A request retried after a failed step runs alone (see Request.retry_alone): not
            # beside other requests, nor beside the step's bulk decodes.
            if request.retry_alone and (scheduled or bulk.step is not None):
                break
            # A hybrid model's request needs a recurrent-state slot as well as blocks (a free
            # one or a checkpoint's), and waits for one as it would for blocks.
            if not self._checkpoints.may_admit() and not self.kv.state_slots.slot_of(request.request_id):
                break
            # Last of the checks that stop it, so no request is preempted for one that then waits.
            if len(self.running) >= self.config.max_num_seqs and not self._preempt_for(request, scheduled):
                break
            hashes = self.prefix_hashes(request)
            if self.kv.is_swapped(request.request_id) and (
                # Swapped out: back once the tokens of its steps in flight are in, into fresh
                # blocks that the plan fills from the host tier.
                request.num_pending_outputs
                or not self.kv.swap_in(
                    request.request_id, request.cache_salt, request.num_computed_tokens + min(request.num_uncomputed_tokens, budget)
                )
            ):
                break
            if self.kv.holds(request.request_id):
                # It arrived with its K/V (import_request, swap_in): it computes on from there.
                num_new = min(request.num_uncomputed_tokens, budget)
                if self._allocate(request, num_new) is None:
                    if self._preempt_for(request, scheduled):
                        continue
                    break
                self._admitted(request, request.num_computed_tokens, hashes, admitted, num_new)
                scheduled[request] = num_new
                budget -= num_new
                if request.retry_alone:
                    break
                continue
            source = self._fork_source(request) if request.fork_of else None
            if source is _AWAIT_FORK:
                self._deferred.append(self.waiting.pop())
                continue
            if isinstance(source, Request):
                if not self._fork(request, source):
                    break
                self._admitted(request, request.num_prompt_tokens - 1, hashes, admitted, 1)
                scheduled[request] = 1
                budget -= 1
                continue
            # A scored prompt is computed whole: cached positions would have no logits.
            scores_prompt = request.sampling.prompt_logprobs is not None
            hit = PrefixHit() if scores_prompt else self.kv.find_cached_prefix(request.token_ids, request.cache_salt, hashes)
            found = hit.num_tokens // self.config.block_size
            if not scores_prompt and found < len(hashes) and hashes[found] in self._prefixes.computing:
                self._deferred.append(self.waiting.pop())
                continue
            # A hybrid model's hit reaches back to its last checkpoint (checkpoint_policy).
            resumed = self._checkpoints.resume_point(hit, bool(self.running))
            if resumed is None:
                break
            hit = resumed
            num_new = request.num_tokens - hit.num_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self._allocate(request, num_new, hit) is None:
                # Room made by preempting a request it outranks, then the head looked at afresh:
                # the preemption changed the caches this hit was found in (a swap-out to the host
                # tier may evict the very host blocks it names).
                if self._preempt_for(request, scheduled):
                    continue
                break
            self._admitted(request, hit.num_tokens, hashes, admitted, num_new, hit)
            scheduled[request] = num_new
            budget -= num_new
            if request.retry_alone:
                break
        return budget

    def _preempt_for(self, request: Request, scheduled: dict[Request, int]) -> bool:
        """Makes room for a waiting request by preempting the lowest-ranked of the running
        requests it outranks (policy.preempts); False, changing nothing, when it outranks none.
        Requests with a part of their own in this plan, or leaving, are not taken. Under fair
        the victim is chosen among those it outranks: the tenant furthest over its share may
        hold only requests it does not outrank while its own tenant holds one it does."""
        policy = self.config.policy
        # Cheap first: with every priority alike (the common case) no request preempts.
        if policy is Policy.FCFS or not self.running or request.priority >= max(r.priority for r in self.running):
            return False
        candidates = [
            r for r in self.running if not r.moving and r not in scheduled and preempts(request, r, policy, self.share)
        ]
        if not candidates:
            return False
        self._preempt(pick_victim(candidates, policy, self.share), swap=True)
        return True

    def _admitted(
        self,
        request: Request,
        num_computed: int,
        hashes: list[BlockHash],
        admitted: list[Request],
        num_new: int,
        hit: PrefixHit | None = None,
    ) -> None:
        """The head of the queue runs from here, its first num_computed tokens already in its
        blocks (a prefix hit, resumed from hit.state_source_slot for a hybrid model; or a
        fork), computing num_new this step."""
        self.waiting.pop()
        if self.config.policy is Policy.FAIR:
            # Charged now, not with the plan, so the next admission of this step sees it.
            self.share.charge(request.tenant, num_new)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
            request.num_cached_tokens = num_computed
        if request.num_lost_tokens:
            self.recomputed_tokens[request.lost_reason] += max(0, request.num_lost_tokens - num_computed)
            request.num_lost_tokens, request.lost_reason = 0, ""
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        request.prefill_target = request.num_tokens
        # Free or a checkpoint's: _admit_waiting checked (one that arrived with its state holds
        # its own). Released with its blocks whenever it stops running.
        if not self.kv.state_slots.slot_of(request.request_id):
            self._checkpoints.admit(request.request_id, hit)
        # Without a prefix cache its blocks are never found by another request: one sharing
        # them must not be held back to wait for them (see _admit_waiting).
        if self.config.enable_prefix_caching:
            self._prefixes.computing.add(request, hashes[num_computed // self.config.block_size :])
        self.running.append(request)
        admitted.append(request)

    def may_fork(self, request: Request) -> bool:
        """Whether the request would fork here from its first choice's prompt (see _fork_source)
        rather than compute its own: what the router places sibling choices together for."""
        return self._fork_source(request) is not None

    def _fork_source(self, request: Request) -> Request | _AwaitFork | None:
        """The sibling whose prompt K/V the request takes (request.fork_of) when it is running
        here and has written all but the prompt's last token, which the request computes itself
        for its own first logits; _AWAIT_FORK while that sibling is queued or computing its
        prompt here; None when no fork applies (the request computes its prompt like any; a
        request retried after a failed step, which runs alone, among them)."""
        config = self.config
        sampling = request.sampling
        if not config.block_copies or request.num_output_tokens or sampling.prompt_logprobs is not None or request.retry_alone:
            return None
        source = self.requests.get(request.fork_of)
        shared = request.num_prompt_tokens - 1
        if source is None or source is request or shared == 0 or not self._same_prompt(source, request, shared):
            return None
        if source.status is RequestStatus.RUNNING and self.kv.num_written(source.request_id) >= shared:
            return source
        return _AWAIT_FORK

    def _same_prompt(self, source: Request, request: Request, shared: int) -> bool:
        """Whether both begin with the same `shared` tokens under the same salt: their chained
        block hashes agree up to the request's last full block, and the tokens after it do."""
        if source.cache_salt != request.cache_salt or source.num_tokens < shared:
            return False
        mine, theirs = self.prefix_hashes(request), self.prefix_hashes(source)
        hashed = min(len(mine), shared // self.config.block_size)
        if hashed and (len(theirs) < hashed or theirs[hashed - 1] != mine[hashed - 1]):
            return False
        start = hashed * self.config.block_size
        return source.token_ids[start:shared] == request.prompt_token_ids[start:shared]

    def _fork(self, request: Request, source: Request) -> bool:
        """Gives the request the source's K/V of all but the prompt's last token, and a block
        for that token; False, changing nothing, when the blocks are not there."""
        shared = request.num_prompt_tokens - 1
        try:
            copy = self.kv.fork(source.request_id, request.request_id, shared)
        except PoolExhausted:
            return False
        if self.kv.allocate_slots(request.request_id, request.token_ids, shared, 1) is None:
            self.kv.free(request.request_id)
            return False
        if copy is not None:
            self._copies.append(copy)
        return True

    def _allocate(self, request: Request, num_new: int, hit: PrefixHit | None = None) -> list[int] | None:
        return self.kv.allocate_slots(
            request.request_id,
            request.token_ids,
            hit.num_tokens if hit else request.num_computed_tokens,
            num_new,
            hit,
            extra_key=request.cache_salt,
        )

    def _preempt(self, request: Request, swap: bool = False) -> None:
        """Preemption: the blocks go, the tokens stay, the request waits at the head. For want
        of blocks (swap) with a host tier that has room, its K/V goes there and comes back with
        it; else it is recomputed."""
        if swap and self._swap_out(request):
            return
        if request.status is RequestStatus.WAITING:
            # Swapped out while a step of it was in flight, which failed: the K/V it kept lacks
            # that step's.
            self.kv.free(request.request_id)
            request.lose_kv("preempted")
            request.num_pending_outputs = 0
            request.num_preemptions += 1
            return
        if request in self.decodes:
            self.decodes.leave(request)
        self.running.remove(request)
        self.kv.free(request.request_id)
        self._forget_on_executor(request.request_id)
        self._prefixes.computing.remove(request)
        self._stop_moving(request)
        request.status = RequestStatus.WAITING
        request.lose_kv("preempted")
        request.num_pending_outputs = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def _held_handles(self) -> list[int]:
        """What Handles asks when its count wraps: the handles the executor's requests hold."""
        return [self.requests[i].handle for i in self._on_executor if i in self.requests]

    def _forget_on_executor(self, request_id: str) -> None:
        if request_id in self._on_executor:
            self._on_executor.discard(request_id)
            self._to_drop.append(request_id)

    def _build_plan(
        self,
        scheduled: dict[Request, int],
        new_blocks: dict[str, list[int]],
        admitted: list[Request],
        bulk: "_BulkPlan",
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
