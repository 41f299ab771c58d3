"""The step planner: which requests run this step, how many tokens each computes, which blocks
they use. The parts of a step are mixins of Scheduler, each in a file of its own (see Scheduler);
the bookkeeping when the step's tokens come back is in step_results.py."""

import itertools
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable

from kv_manager import (
    BlockCopy,
    BlockHash,
    KVCacheManager,
    PrefixHit,
    prefix_hash,
)
from scheduler_service.core.admission import Admission
from scheduler_service.core.checkpoint_policy import CheckpointPolicy
from scheduler_service.core.config import SchedulerConfig, SchedulingKnobs
from scheduler_service.core.decode_set import BulkStep, DecodeSet
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.forks import Forks
from scheduler_service.core.handles import Handles
from scheduler_service.core.length_limits import (
    check_room_in_cache,
    check_room_under_model_length,
)
from scheduler_service.core.move_books import (
    MoveBooks,
)
from scheduler_service.core.plan_builder import PlanBuilder
from scheduler_service.core.policy import StepMode
from scheduler_service.core.prefill_share import prefill_within
from scheduler_service.core.prefix_tracker import PrefixTracker
from scheduler_service.core.request import FinishReason, Request, RequestStatus
from scheduler_service.core.request_queue import WaitingQueue
from scheduler_service.core.running_plan import NO_BULK, RunningPlan
from scheduler_service.core.scheduler_moves import RequestMoves
from scheduler_service.core.speculation import Drafts, Speculation
from scheduler_service.core.step_plan import StepPlan
from scheduler_service.core.step_results import InFlight, StepResults
from scheduler_service.core.suffix_proposer import SuffixTable


class Scheduler(RunningPlan, Admission, Forks, PlanBuilder, RequestMoves, StepResults):
    """Owns the waiting and running queues and the KV block pool of one executor. How it plans
    the running requests' part of a step is in running_plan.py, whom it admits in admission.py
    (forks in forks.py), how it writes the plan in plan_builder.py; its side of K/V moves and
    host-tier swaps is in scheduler_moves.py, how it takes in a step's answer in
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
            return self._build_plan(scheduled, new_blocks, admitted, NO_BULK)
        self.speculation.begin_step(self.running)
        bulk = NO_BULK
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

    # ---- blocks and preemption, for every part of a step -------------------------------------

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
