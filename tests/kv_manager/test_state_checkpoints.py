"""Recurrent-state checkpoints (kv_manager/state_checkpoints.py) through the KV cache manager as
the scheduler uses them: a hybrid model's prefix hit is cut back to its last block with a ready
checkpoint, checkpoints share the state slots with running requests (which take the least
recently used one's when no slot is free), and one goes with its block. Random interleavings
against a model of the books, and the audit naming each corruption injected on purpose."""

from collections import OrderedDict

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

from kv_manager import BlockHash, KVCacheManager, SlotsExhausted
from kv_manager.audit import checkpoint_mismatches, pool_mismatches

BLOCK_SIZE = 4
NUM_BLOCKS = 12


def computed(kv: KVCacheManager, request_id: str, tokens: list[int]) -> list[BlockHash]:
    """Admits a request without a hit, computes its tokens and returns its blocks' hashes."""
    assert kv.allocate_slots(request_id, tokens, 0, len(tokens)) is not None
    kv.take_state_slot(request_id)
    kv.cache_computed(request_id, tokens, len(tokens))
    hashes = [kv.registered_hash(request_id, i) for i in range(len(tokens) // BLOCK_SIZE)]
    assert None not in hashes
    return hashes  # type: ignore[return-value]


def checkpoint(kv: KVCacheManager, block_hash: BlockHash) -> int:
    slot = kv.checkpoints.reserve(block_hash)
    assert slot and kv.fill_checkpoint(slot, block_hash)
    return slot


def test_a_hybrid_hit_is_cut_back_to_its_last_block_with_a_ready_checkpoint() -> None:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, num_state_slots=4)
    tokens = list(range(1, 18))
    hashes = computed(kv, "a", tokens)
    follower = tokens[:16] + [99, 98]
    whole = kv.find_cached_prefix(follower)
    assert whole.num_tokens == 16
    assert kv.resumable(whole) == type(whole)(), "no checkpoint: nothing to resume from"
    first = checkpoint(kv, hashes[0])
    second = checkpoint(kv, hashes[2])
    # Block 3's checkpoint is pending: it is never read before it is made.
    pending = kv.checkpoints.reserve(hashes[3])
    cut = kv.resumable(whole)
    assert (cut.num_tokens, cut.state_source_slot, cut.blocks) == (12, second, whole.blocks[:3])
    kv.checkpoints.forget(hashes[2])
    cut = kv.resumable(whole)
    assert (cut.num_tokens, cut.state_source_slot) == (4, first)
    kv.checkpoints.cancel(pending)
    assert pool_mismatches(kv) == []
    # A model without recurrent layers resumes anywhere: its hit is whole.
    plain = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    plain.allocate_slots("a", tokens, 0, len(tokens))
    plain.cache_computed("a", tokens, len(tokens))
    hit = plain.find_cached_prefix(follower)
    assert plain.resumable(hit) is hit and hit.state_source_slot == 0


def test_a_request_takes_the_least_recently_used_checkpoint_outside_the_plans_reads() -> None:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, num_state_slots=4)
    hashes = computed(kv, "a", list(range(1, 14)))
    slots = [checkpoint(kv, block_hash) for block_hash in hashes[:3]]
    assert kv.state_slots.num_free == 0
    assert kv.stats().num_free_state_slots == 3, "slots keeping checkpoints count as free"
    assert kv.checkpoints.use(hashes[0]) == slots[0]  # block 0's is now the most recently used
    assert kv.take_state_slot("b", keep={slots[1]}) == slots[2]
    assert list(kv.checkpoints.ready()) == [hashes[1], hashes[0]]
    assert not kv.may_take_state_slot(keep=set(slots[:2]))
    with pytest.raises(SlotsExhausted):
        kv.take_state_slot("c", keep=set(slots[:2]))
    assert kv.state_slots.slot_of("c") == 0 and len(kv.checkpoints.ready()) == 2
    # A pending checkpoint is not taken: its step writes it.
    kv.free("b")
    pending = kv.checkpoints.reserve(None)
    assert kv.allocate_slots("c", [5], 0, 1) is not None
    assert pending == slots[2] and kv.take_state_slot("c") == slots[1]
    assert kv.checkpoints.reserve(None, keep={slots[0]}) == 0
    assert pool_mismatches(kv) == []


def test_a_checkpoint_goes_with_its_block_and_a_second_of_one_prefix_gives_its_slot_back() -> None:
    kv = KVCacheManager(3, BLOCK_SIZE, num_state_slots=3)
    hashes = computed(kv, "a", list(range(1, 9)))
    slot = checkpoint(kv, hashes[1])
    twin = kv.checkpoints.reserve(None)
    assert not kv.fill_checkpoint(twin, hashes[1]), "one checkpoint per prefix"
    assert kv.checkpoints.ready() == {hashes[1]: slot} and twin in kv.state_slots.free_slots()
    kv.free("a")
    late = kv.checkpoints.reserve(hashes[0])
    # b needs every block: a's cached ones are evicted, and block 1's checkpoint with them.
    assert kv.allocate_slots("b", list(range(50, 62)), 0, 12) is not None
    assert kv.checkpoints.ready() == {} and slot in kv.state_slots.free_slots()
    kv.take_state_slot("b")
    assert not kv.fill_checkpoint(late, hashes[0]), "its block left the cache while it was made"
    assert kv.state_slots.lent_slots() == set()
    assert pool_mismatches(kv) == []


def test_the_audit_names_each_checkpoint_corruption() -> None:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, num_state_slots=4)
    hashes = computed(kv, "a", list(range(1, 14)))
    first, second = checkpoint(kv, hashes[0]), checkpoint(kv, hashes[1])
    pending = kv.checkpoints.reserve(hashes[2])
    assert pool_mismatches(kv) == []
    checkpoints, slots = kv.checkpoints, kv.state_slots
    cached = kv.pool.cached_hashes().keys()
    checkpoints._ready[hashes[1]] = first  # two checkpoints in one slot, and the second's lost
    assert checkpoint_mismatches(checkpoints, slots, cached) == [
        f"state slot {first}: keeps 2 checkpoints",
        f"state slot {second}: lent to a checkpoint that does not keep it",
    ]
    checkpoints._ready[hashes[1]] = second
    assert checkpoint_mismatches(checkpoints, slots, set(cached) - {hashes[0]}) == [
        f"state slot {first}: keeps a ready checkpoint of block {hashes[0].hex()}, which is not cached"
    ]
    slots._lent.discard(pending)
    slots._free.append(pending)
    assert checkpoint_mismatches(checkpoints, slots, cached) == [
        f"state slot {pending}: keeps a checkpoint but is not lent to one"
    ]
    slots._lent.add(pending)
    assert f"state slot {pending}: free yet lent to a checkpoint" in pool_mismatches(kv)


class CheckpointMachine(RuleBasedStateMachine):
    """Requests over a few shared stems are admitted as the scheduler admits them (the hit cut
    back to a checkpoint, which the plan then reads; a slot taken outside the plan's reads),
    compute their tokens, make checkpoints at block boundaries that are filled or cancelled,
    and leave. The model: who holds which slot, and the ready checkpoints in LRU order, less
    those whose block the pool has evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.held: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        # Slots read in the plan being made: taken by no one until the next plan.
        self.reads: set[int] = set()
        self.ready: OrderedDict[BlockHash, int] = OrderedDict()
        self.pending: dict[int, BlockHash] = {}
        self.next_id = 0

    @initialize(num_slots=st.integers(1, 5))
    def start(self, num_slots: int) -> None:
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, num_state_slots=num_slots)

    @rule(stem=st.integers(0, 2), length=st.integers(1, 14), tail=st.integers(0, 3))
    def admit(self, stem: int, length: int, tail: int) -> None:
        tokens = [1000 * stem + i for i in range(length)] + [7000 + self.next_id] * tail
        request_id = f"r{self.next_id}"
        self.next_id += 1
        whole = self.kv.find_cached_prefix(tokens)
        hit = self.kv.resumable(whole)
        assert hit.num_tokens <= whole.num_tokens and hit.num_tokens % BLOCK_SIZE == 0
        assert hit.blocks == whole.blocks[: len(hit.blocks)]
        if hit.blocks:
            last = hit.blocks[-1].block_hash
            assert last is not None and self.ready.get(last) == hit.state_source_slot
            later = [b.block_hash for b in whole.blocks[len(hit.blocks) :]]
            assert not any(h in self.ready for h in later), "the hit was cut short of a checkpoint"
        else:
            assert hit.state_source_slot == 0
            assert not any(b.block_hash in self.ready for b in whole.blocks)
        keep = self.reads | ({hit.state_source_slot} - {0})
        if not self.kv.may_take_state_slot(keep):
            assert self.kv.state_slots.num_free == 0
            assert all(slot in keep for slot in self.ready.values())
            return
        if self.kv.allocate_slots(request_id, tokens, hit.num_tokens, len(tokens) - hit.num_tokens, hit) is None:
            return
        self.forget_evicted()
        if hit.blocks:
            assert self.kv.checkpoints.use(hit.blocks[-1].block_hash) == hit.state_source_slot  # type: ignore[arg-type]
            self.ready.move_to_end(hit.blocks[-1].block_hash)  # type: ignore[arg-type]
            self.reads.add(hit.state_source_slot)
        free_before = self.kv.state_slots.num_free
        slot = self.kv.take_state_slot(request_id, keep)
        if not free_before:
            evicted = next(h for h, s in self.ready.items() if s not in keep)
            assert self.ready.pop(evicted) == slot, "not the least recently used checkpoint outside the reads"
        assert slot not in self.held.values() and slot not in self.pending and slot not in keep
        self.held[request_id] = slot
        self.tokens[request_id] = tokens
        self.kv.cache_computed(request_id, tokens, len(tokens))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), fill=st.booleans())
    def make_checkpoint(self, data: st.DataObject, fill: bool) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.held)))
        num_blocks = len(self.tokens[request_id]) // BLOCK_SIZE
        if not num_blocks:
            return
        block_hash = self.kv.registered_hash(request_id, data.draw(st.integers(0, num_blocks - 1)))
        assert block_hash is not None
        if self.kv.checkpoints.known(block_hash):
            assert block_hash in self.ready or block_hash in self.pending.values()
            return
        free_before = self.kv.state_slots.num_free
        slot = self.kv.checkpoints.reserve(block_hash, self.reads)
        if not slot:
            assert not free_before and all(s in self.reads for s in self.ready.values())
            return
        if not free_before:
            evicted = next(h for h, s in self.ready.items() if s not in self.reads)
            assert self.ready.pop(evicted) == slot
        self.pending[slot] = block_hash
        if fill:
            self.fill(slot)

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), made=st.booleans())
    def step_done(self, data: st.DataObject, made: bool) -> None:
        slot = data.draw(st.sampled_from(sorted(self.pending)))
        if made:
            self.fill(slot)
        else:
            del self.pending[slot]
            self.kv.checkpoints.cancel(slot)

    def fill(self, slot: int) -> None:
        block_hash = self.pending.pop(slot)
        assert self.kv.fill_checkpoint(slot, block_hash) == (
            self.kv.pool.lookup(block_hash) is not None and block_hash not in self.ready
        )
        if self.kv.pool.lookup(block_hash) is not None:
            self.ready[block_hash] = self.ready.get(block_hash, slot)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.held)))
        del self.held[request_id], self.tokens[request_id]
        self.kv.free(request_id)
        # As in the scheduler, where requests leave between plans or, preempted, before a plan
        # reads any checkpoint: a read checkpoint's blocks are held until the plan is made.
        self.reads.clear()

    @rule()
    def next_plan(self) -> None:
        self.reads.clear()

    def forget_evicted(self) -> None:
        """A checkpoint goes when the pool evicts its block."""
        for block_hash in [h for h in self.ready if self.kv.pool.lookup(h) is None]:
            del self.ready[block_hash]

    @invariant()
    def the_books_match_the_model(self) -> None:
        self.forget_evicted()
        assert list(self.kv.checkpoints.ready().items()) == list(self.ready.items())
        assert self.kv.checkpoints.pending() == self.pending
        assert self.kv.state_slots.holders() == self.held
        assert pool_mismatches(self.kv) == []


CheckpointMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCheckpointProperties = CheckpointMachine.TestCase
