"""Recurrent-state slots of a hybrid model's executor (Mamba, Gated DeltaNet, short
convolutions): such a model keeps one fixed-size state per running request beside its K/V, in a
slot the scheduler hands out like a block. Slots are numbered 1..num_slots; 0 names no slot, as
on the wire (ExecutorInfo.num_state_slots, NewRequest.state_slot). A slot no request holds may
be lent to a checkpoint (kv_manager/state_checkpoints.py), which keeps the state at the end of a
cached prefix there."""

from collections import deque


class SlotsExhausted(Exception):
    """No free state slot for what was asked; nothing was changed."""


class StateSlotPool:
    """Which request holds which slot, and which slots are lent to checkpoints. Free slots are
    reused least recently freed first, as blocks are."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must not be negative, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(1, num_slots + 1))
        self._slot_of: dict[str, int] = {}
        self._lent: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Slots held by requests."""
        return len(self._slot_of)

    @property
    def exhausted(self) -> bool:
        """Whether no slot is free. Never for a model without recurrent layers (num_slots 0),
        whose requests need none. A slot lent to a checkpoint may still be taken back for a
        request (KVCacheManager.take_state_slot)."""
        return self.num_slots > 0 and not self._free

    def allocate(self, request_id: str) -> int:
        """Takes a free slot for the request and returns it; 0, holding nothing, when the model
        has no recurrent layers. Raises SlotsExhausted, changing nothing, when none is free;
        ValueError when the request holds one already (a second would leak the first)."""
        if not self.num_slots:
            return 0
        if request_id in self._slot_of:
            raise ValueError(f"request {request_id} already holds state slot {self._slot_of[request_id]}")
        if not self._free:
            raise SlotsExhausted(f"all {self.num_slots} state slots are held")
        slot = self._slot_of[request_id] = self._free.popleft()
        return slot

    def free(self, request_id: str) -> int:
        """Releases the request's slot and returns it (0 if it held none). Idempotent."""
        slot = self._slot_of.pop(request_id, 0)
        if slot:
            self._free.append(slot)
        return slot

    def lend(self) -> int:
        """Takes a free slot for a checkpoint and returns it. Raises SlotsExhausted, changing
        nothing, when none is free."""
        if not self._free:
            raise SlotsExhausted(f"all {self.num_slots} state slots are held")
        slot = self._free.popleft()
        self._lent.add(slot)
        return slot

    def take_back(self, slot: int) -> None:
        """Frees a slot lent to a checkpoint; ValueError when it is not lent."""
        if slot not in self._lent:
            raise ValueError(f"state slot {slot} is not lent to a checkpoint")
        self._lent.remove(slot)
        self._free.append(slot)

    def rename(self, request_id: str, owner: str) -> None:
        """Moves the request's slot, as it is, under another owner's name (a request leaving
        with its state keeps it held under the move's name)."""
        if owner in self._slot_of:
            raise ValueError(f"{owner!r} already holds state slot {self._slot_of[owner]}")
        slot = self._slot_of.pop(request_id, 0)
        if slot:
            self._slot_of[owner] = slot

    def slot_of(self, request_id: str) -> int:
        """The request's slot, or 0 when it holds none."""
        return self._slot_of.get(request_id, 0)

    def holders(self) -> dict[str, int]:
        """Request id -> its slot (for the audit and tests)."""
        return dict(self._slot_of)

    def free_slots(self) -> list[int]:
        """Free slots in reuse order (for the audit and tests)."""
        return list(self._free)

    def lent_slots(self) -> set[int]:
        """Slots lent to checkpoints (for the audit and tests)."""
        return set(self._lent)
