"""Recurrent-state checkpoints of a hybrid model: the state after a cached prefix, kept in a
state slot of its own, so that a request sharing the prefix resumes from it (its K/V from the
prefix cache's blocks, its recurrent state copied from here) instead of computing it again.

A checkpoint is named by the prefix-cache hash of the block that ends at its point, which covers
the whole prefix. It is pending from the plan that makes it (StepPlan.state_checkpoints) until
that plan's result is in, then ready, or dropped if the step did not run; only a ready one is
read (NewRequest.state_source_slot). Ready checkpoints are a cache in the same slots the running
requests hold: a request that needs a slot when none is free takes the least recently used one's,
and one whose block leaves the prefix cache goes at once, as nothing could resume from it."""

from collections import OrderedDict
from collections.abc import Collection

from kv_manager.prefix_hash import BlockHash
from kv_manager.state_slots import SlotsExhausted, StateSlotPool


class StateCheckpoints:
    """Which slot keeps which prefix's state; the slots are lent by the StateSlotPool."""

    def __init__(self, slots: StateSlotPool) -> None:
        self._slots = slots
        # Ready checkpoints, block hash -> slot, least recently used first.
        self._ready: OrderedDict[BlockHash, int] = OrderedDict()
        # Pending checkpoints, slot -> block hash; None while the block's last token was not
        # known when planned (a decode of the token still in flight): named when it is filled.
        self._pending: dict[int, BlockHash | None] = {}
        self._pending_hashes: set[BlockHash] = set()

    def slot(self, block_hash: BlockHash) -> int:
        """The slot of the ready checkpoint named block_hash, or 0."""
        return self._ready.get(block_hash, 0)

    def use(self, block_hash: BlockHash) -> int:
        """The slot of the ready checkpoint named block_hash, now the most recently used."""
        self._ready.move_to_end(block_hash)
        return self._ready[block_hash]

    def known(self, block_hash: BlockHash) -> bool:
        """Whether a checkpoint by that name is ready or pending."""
        return block_hash in self._ready or block_hash in self._pending_hashes

    def can_take(self, keep: Collection[int] = ()) -> bool:
        """Whether a slot is free, or kept by a ready checkpoint outside keep."""
        return self._slots.num_free > 0 or self._evictable(keep) is not None

    def take_for_request(self, request_id: str, keep: Collection[int] = ()) -> int:
        """A slot for the request (StateSlotPool.allocate; 0 for a model without recurrent
        layers): a free one, else the least recently used ready checkpoint's outside keep
        (slots read in the plan being made). Raises SlotsExhausted, changing nothing, when
        there is neither."""
        if self._slots.exhausted:
            evicted = self._evictable(keep)
            if evicted is None:
                raise SlotsExhausted("every state slot is held by a request or a checkpoint in use")
            self._slots.take_back(self._ready.pop(evicted))
        return self._slots.allocate(request_id)

    def reserve(self, block_hash: BlockHash | None, keep: Collection[int] = ()) -> int:
        """A slot for a checkpoint a plan is about to make, pending from now: a free one, else
        the least recently used ready checkpoint's outside keep; 0 when there is neither."""
        if self._slots.num_free:
            slot = self._slots.lend()
        else:
            evicted = self._evictable(keep)
            if evicted is None:
                return 0
            slot = self._ready.pop(evicted)
        self._pending[slot] = block_hash
        if block_hash is not None:
            self._pending_hashes.add(block_hash)
        return slot

    def fill(self, slot: int, block_hash: BlockHash) -> bool:
        """The pending checkpoint in slot was made, for the prefix named block_hash: it is ready,
        the most recently used. False, its slot freed, when a ready one by that name exists
        (made meanwhile by another request)."""
        self._unpend(slot)
        if block_hash in self._ready:
            self._slots.take_back(slot)
            return False
        self._ready[block_hash] = slot
        return True

    def cancel(self, slot: int) -> None:
        """The pending checkpoint in slot was not made (its step failed, its request was
        refused): its slot is freed."""
        self._unpend(slot)
        self._slots.take_back(slot)

    def forget(self, block_hash: BlockHash) -> None:
        """The block named block_hash left the prefix cache: its ready checkpoint, if any, goes."""
        slot = self._ready.pop(block_hash, 0)
        if slot:
            self._slots.take_back(slot)

    def ready(self) -> dict[BlockHash, int]:
        """Ready checkpoints, name -> slot, least recently used first (for the audit and tests)."""
        return dict(self._ready)

    def pending(self) -> dict[int, BlockHash | None]:
        """Pending checkpoints, slot -> name (for the audit and tests)."""
        return dict(self._pending)

    def _unpend(self, slot: int) -> None:
        if slot not in self._pending:
            raise ValueError(f"state slot {slot} holds no pending checkpoint")
        block_hash = self._pending.pop(slot)
        if block_hash is not None:
            self._pending_hashes.discard(block_hash)

    def _evictable(self, keep: Collection[int]) -> BlockHash | None:
        """The least recently used ready checkpoint whose slot is not in keep."""
        return next((block_hash for block_hash, slot in self._ready.items() if slot not in keep), None)
