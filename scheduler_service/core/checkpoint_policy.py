"""Prefix caching for a hybrid model: where its requests' recurrent state is kept, and what a
prefix hit resumes from (issue 38).

A request that computes tokens (a, b] in a step keeps its state after every multiple p of the
checkpoint interval (SchedulerConfig.state_checkpoint_tokens) in (a, b] that no checkpoint,
ready or pending, names yet: StateCheckpoint(request, p, slot) in the plan, in a free slot or
the least recently used ready checkpoint's (none: it keeps no more this step). Prompt and
generated tokens alike, as the prefix cache hashes both. A checkpoint is named by the hash of
the block that ends at p, and is pending until the step's result is in: filled when the step
computed the request and cached its blocks up to p (made), dropped, its slot freed, otherwise
(step_done: a failed step, a refused request, or one that left meanwhile). So only plans made
after that result read it, and none reads the plan's own.

A hit is cut back to its last block with a ready checkpoint (KVCacheManager.resumable), whose
slot the request's NewRequest names as state_source_slot; the executor copies it at admission,
before the step's forward, so the slots the plan being made reads are taken by no one in it.
"""

from collections.abc import Callable, Iterable

from kv_manager import BlockHash, KVCacheManager, PrefixHit, hash_block_tokens
from kv_manager.prefix_hash import ROOT_HASH
from scheduler_service.core.request import Request
from scheduler_service.core.step_plan import StateCheckpoint


class CheckpointPolicy:
    """One scheduler's checkpoint decisions over its KV cache manager's books (replaced with
    them when its executor is lost)."""

    def __init__(self, kv: KVCacheManager, interval: int, prefix_hashes: Callable[[Request], list[BlockHash]]) -> None:
        self.kv = kv
        # Tokens between checkpoints; 0: none are kept.
        self.interval = interval
        self._prefix_hashes = prefix_hashes
        # step id -> request id -> (point, slot) of each checkpoint the step makes, until its
        # result is in.
        self._pending: dict[int, dict[str, list[tuple[int, int]]]] = {}
        # request id -> the checkpoint slot it resumes from, for the plan being made.
        self._reads: dict[str, int] = {}

    def resume_point(self, hit: PrefixHit, others_running: bool) -> PrefixHit | None:
        """What a request being admitted resumes from of its prefix hit (resumable), or None
        when it waits instead: it needs a slot of its own beside the checkpoint it reads, and
        the only one to take is that checkpoint's. A running request frees one when it ends;
        with none running it computes the prefix itself rather than wait for nothing."""
        hit = self.kv.resumable(hit)
        if not hit.state_source_slot or self.kv.may_take_state_slot({*self._reads.values(), hit.state_source_slot}):
            return hit
        return None if others_running else PrefixHit()

    def may_admit(self) -> bool:
        """Whether a request could take a state slot now (free, or a checkpoint's that the
        plan being made does not read)."""
        return self.kv.may_take_state_slot(self._reads.values())

    def admit(self, request_id: str, hit: PrefixHit | None) -> None:
        """Takes the admitted request's state slot, and marks the checkpoint it resumes from
        (hit.state_source_slot) as read: the most recently used, and taken by no one until
        the plan is made."""
        if hit is not None and hit.state_source_slot:
            last = hit.blocks[-1].block_hash
            assert last is not None  # a cached block
            self.kv.checkpoints.use(last)
            self._reads[request_id] = hit.state_source_slot
        self.kv.take_state_slot(request_id, self._reads.values())

    def take_slot(self, request_id: str) -> int:
        """A state slot for a request arriving with its recurrent state (a move): free, or a
        checkpoint's the plan being made does not read. Raises SlotsExhausted when none is."""
        return self.kv.take_state_slot(request_id, self._reads.values())

    def source_of(self, request_id: str) -> int:
        """The checkpoint slot the request resumes from in the plan being made, or 0."""
        return self._reads.get(request_id, 0)

    def plan(self, step_id: int, spans: Iterable[tuple[Request, int, int]]) -> list[StateCheckpoint]:
        """The checkpoints the plan being made keeps, given what its requests compute
        (request, tokens computed before, after); the plan's reads end here."""
        made: list[StateCheckpoint] = []
        keep = set(self._reads.values())
        self._reads.clear()
        if not self.interval:
            return made
        pending: dict[str, list[tuple[int, int]]] = {}
        interval = self.interval
        points = (
            (request, point)
            for request, start, end in spans
            for point in range((start // interval + 1) * interval, end + 1, interval)
        )
        for request, point in points:
            name = self._name(request, point)
            if name is not None and self.kv.checkpoints.known(name):
                continue
            slot = self.kv.checkpoints.reserve(name, keep)
            if not slot:
                # Reserving frees nothing: no later point would find a slot either.
                break
            pending.setdefault(request.request_id, []).append((point, slot))
            made.append(StateCheckpoint(request.request_id, point, slot))
        if pending:
            self._pending[step_id] = pending
        return made

    def made(self, step_id: int, request_ids: Iterable[str]) -> None:
        """The step computed the requests and their blocks are cached: their checkpoints of
        that step are ready, named by the hashes their blocks were cached under."""
        pending = self._pending.get(step_id)
        if not pending:
            return
        for request_id in request_ids:
            for point, slot in pending.pop(request_id, ()):
                name = self.kv.registered_hash(request_id, point // self.kv.block_size - 1)
                if name is None:
                    self.kv.checkpoints.cancel(slot)
                else:
                    self.kv.fill_checkpoint(slot, name)

    def step_done(self, step_id: int) -> None:
        """The step's result is applied: its checkpoints not made are dropped."""
        for points in self._pending.pop(step_id, {}).values():
            for _, slot in points:
                self.kv.checkpoints.cancel(slot)

    def _name(self, request: Request, point: int) -> BlockHash | None:
        """The prefix-cache hash of the request's block ending at point, or None while its
        last token is not back yet (a pipelined decode)."""
        if point > request.num_tokens:
            return None
        index = point // self.kv.block_size - 1
        hashes = self._prefix_hashes(request)
        if index < len(hashes):
            return hashes[index]
        # The block holding the last known token, which the prefix hashes leave out (a hit
        # never covers it): hashed here from the one before.
        parent = hashes[index - 1] if index else ROOT_HASH
        return hash_block_tokens(parent, request.token_ids[point - self.kv.block_size : point], request.cache_salt)
