"""Admission: which waiting requests start running this step, from the head of the queue, each
with its prefix-cache hit, its fork of a sibling's prompt (forks.py) or the K/V it arrived with;
a higher-priority request preempting a running one it outranks; and requests held back until a
prefix block they share with a running request is cached.

A mixin of Scheduler (core/scheduler.py), kept apart as scheduler_moves.py is, so that the rules
of who is admitted, and who waits, read in one file; it works on the scheduler's own books.
"""

from collections import Counter
from collections.abc import Callable

from kv_manager import BlockHash, KVCacheManager, PrefixHit
from scheduler_service.core.checkpoint_policy import CheckpointPolicy
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.fair_share import FairShare
from scheduler_service.core.forks import AWAIT_FORK, AwaitFork
from scheduler_service.core.policy import Policy, pick_victim, preempts
from scheduler_service.core.prefix_tracker import PrefixTracker
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.request_queue import WaitingQueue
from scheduler_service.core.running_plan import NO_BULK, BulkPlan


class Admission:
    """What it uses of the Scheduler it is mixed into."""

    config: SchedulerConfig
    share: FairShare
    clock: Callable[[], float]
    kv: KVCacheManager
    waiting: WaitingQueue
    running: list[Request]
    recomputed_tokens: Counter[str]
    _checkpoints: CheckpointPolicy
    _prefixes: PrefixTracker
    _deferred: list[Request]
    prefix_hashes: Callable[[Request], list[BlockHash]]
    _allocate: Callable[..., list[int] | None]
    _preempt: Callable[..., None]
    # scheduler_moves.py
    _release_held: Callable[[], bool]
    # forks.py
    _fork_source: Callable[[Request], Request | AwaitFork | None]
    _fork: Callable[[Request, Request], bool]

    def _release_deferred(self) -> None:
        """Requeues held-back requests whose next prefix block is no longer being computed
        (it is cached now, or whoever computed it left)."""
        still = []
        for request in self._deferred:
            if request.fork_of:
                if self._fork_source(request) is AWAIT_FORK:
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

    def _admit_waiting(
        self,
        budget: int,
        scheduled: dict[Request, int],
        admitted: list[Request],
        bulk: BulkPlan = NO_BULK,
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
        bulk: BulkPlan,
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
            if source is AWAIT_FORK:
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
