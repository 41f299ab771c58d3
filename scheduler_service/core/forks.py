"""n > 1 on one executor: a request that shares its prompt with a sibling choice (Request.fork_of)
takes that sibling's K/V of the prompt (full blocks shared, a partial last block copied) instead
of computing it again.

A mixin of Scheduler (core/scheduler.py), kept apart as scheduler_moves.py is, so that when a
fork applies reads in one file: admission.py asks it of the head of the queue, the router
(may_fork) of where to place a sibling choice.
"""

from collections.abc import Callable

from kv_manager import BlockCopy, BlockHash, KVCacheManager, PoolExhausted
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request, RequestStatus


class AwaitFork:
    """A forking request's source has yet to write the prompt it shares (see _fork_source)."""


AWAIT_FORK = AwaitFork()


class Forks:
    """What it uses of the Scheduler it is mixed into."""

    config: SchedulerConfig
    kv: KVCacheManager
    requests: dict[str, Request]
    # Block copies for the plan being made.
    _copies: list[BlockCopy]
    prefix_hashes: Callable[[Request], list[BlockHash]]

    def may_fork(self, request: Request) -> bool:
        """Whether the request would fork here from its first choice's prompt (see _fork_source)
        rather than compute its own: what the router places sibling choices together for."""
        return self._fork_source(request) is not None

    def _fork_source(self, request: Request) -> Request | AwaitFork | None:
        """The sibling whose prompt K/V the request takes (request.fork_of) when it is running
        here and has written all but the prompt's last token, which the request computes itself
        for its own first logits; AWAIT_FORK while that sibling is queued or computing its
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
        return AWAIT_FORK

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
