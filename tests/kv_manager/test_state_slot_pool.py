"""Recurrent-state slots (kv_manager/state_slots.py): random interleavings of admit / free /
double allocation / allocation while exhausted, through the KV cache manager as the scheduler
uses it, against a model of who holds what; and the audit names each corruption injected on
purpose."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kv_manager import KVCacheManager, SlotsExhausted, StateSlotPool
from kv_manager.audit import pool_mismatches, state_slot_mismatches

BLOCK_SIZE = 4
NUM_BLOCKS = 10


class StateSlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
        self.num_slots = 0
        # The model: request id -> the slot it holds (0 for a model without recurrent layers).
        self.held: dict[str, int] = {}
        self.next_id = 0

    @initialize(num_slots=st.integers(0, 5))
    def start(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False, num_state_slots=num_slots)

    @rule(num_tokens=st.integers(1, 12))
    def admit(self, num_tokens: int) -> None:
        """As the scheduler admits: a request waits while no slot is free, else takes blocks,
        then its slot."""
        request_id = f"r{self.next_id}"
        self.next_id += 1
        if self.kv.state_slots.exhausted:
            assert self.num_slots > 0 and len(self.held) == self.num_slots
            return
        if self.kv.allocate_slots(request_id, list(range(num_tokens)), 0, num_tokens) is None:
            return
        slot = self.kv.state_slots.allocate(request_id)
        if self.num_slots:
            assert 1 <= slot <= self.num_slots
            assert slot not in self.held.values(), f"slot {slot} handed out twice"
        else:
            assert slot == 0 and not self.kv.state_slots.holders()
        self.held[request_id] = slot

    @precondition(lambda self: self.num_slots > 0 and len(self.held) == self.num_slots)
    @rule()
    def allocating_while_exhausted_changes_nothing(self) -> None:
        free_before = self.kv.state_slots.free_slots()
        with pytest.raises(SlotsExhausted):
            self.kv.state_slots.allocate("one-too-many")
        assert self.kv.state_slots.free_slots() == free_before
        assert self.kv.state_slots.slot_of("one-too-many") == 0

    @precondition(lambda self: self.num_slots > 0 and bool(self.held))
    @rule(data=st.data())
    def allocating_twice_changes_nothing(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.held)))
        free_before = self.kv.state_slots.free_slots()
        with pytest.raises(ValueError):
            self.kv.state_slots.allocate(request_id)
        assert self.kv.state_slots.free_slots() == free_before

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """Finished, aborted or preempted: the blocks and the slot go together."""
        request_id = data.draw(st.sampled_from(sorted(self.held)))
        slot = self.held.pop(request_id)
        self.kv.free(request_id)
        assert self.kv.state_slots.slot_of(request_id) == 0
        if slot:
            assert self.kv.state_slots.free_slots()[-1] == slot, "a freed slot is reused last"

    @rule()
    def freeing_unknown_is_a_no_op(self) -> None:
        before = self.kv.state_slots.free_slots()
        assert self.kv.state_slots.free("never-admitted") == 0
        assert self.kv.state_slots.free_slots() == before

    @invariant()
    def the_books_match_the_model(self) -> None:
        slots = self.kv.state_slots
        assert slots.holders() == {r: s for r, s in self.held.items() if s}
        assert slots.num_free == self.num_slots - len(slots.holders())
        assert sorted(slots.free_slots() + list(slots.holders().values())) == list(range(1, self.num_slots + 1))
        assert slots.exhausted == (self.num_slots > 0 and len(self.held) == self.num_slots)

    @invariant()
    def the_audit_is_clean(self) -> None:
        assert pool_mismatches(self.kv) == []


StateSlotMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStateSlotProperties = StateSlotMachine.TestCase


def test_a_model_without_recurrent_layers_hands_out_slot_zero_and_never_runs_out() -> None:
    slots = StateSlotPool(0)
    assert [slots.allocate(f"r{i}") for i in range(3)] == [0, 0, 0]
    assert not slots.exhausted and slots.holders() == {} and slots.free_slots() == []


def test_the_audit_names_each_corruption() -> None:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False, num_state_slots=3)
    for request_id in ("a", "b"):
        kv.allocate_slots(request_id, [1, 2, 3], 0, 3)
        kv.state_slots.allocate(request_id)
    assert pool_mismatches(kv) == []
    slots = kv.state_slots
    assert state_slot_mismatches(slots, ["a", "b", "c"]) == ["request c: holds blocks but no state slot"]
    assert state_slot_mismatches(slots, ["a"]) == ["request b: holds state slot 2 but no blocks"]
    slots._slot_of["b"] = 1  # two requests in one slot, and slot 2 lost
    assert state_slot_mismatches(slots, ["a", "b"]) == [
        "state slot 1: held by 2 requests ['a', 'b']",
        "state slot 2: neither held, lent nor free",
    ]
    slots._slot_of["b"] = 3  # held and free at once
    assert state_slot_mismatches(slots, ["a", "b"]) == [
        "state slot 3: held by ['b'] yet free",
        "state slot 2: neither held, lent nor free",
    ]
    slots._slot_of["b"] = 2
    slots._free.extend([3, 7])  # free twice over, and a slot that does not exist
    assert state_slot_mismatches(slots, ["a", "b"]) == [
        "state slot 3: free 2 times over",
        "state slot 7: free but outside 1..3",
    ]


def test_a_hybrid_model_has_no_forks() -> None:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False, num_state_slots=2)
    kv.allocate_slots("parent", list(range(6)), 0, 6)
    kv.cache_computed("parent", list(range(6)), 6)
    with pytest.raises(ValueError, match="cannot fork"):
        kv.fork("parent", "child", 5)
    assert not kv.holds("child")
