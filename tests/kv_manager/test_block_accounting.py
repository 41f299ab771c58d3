"""Behaviour of the KV cache manager that a scheduler relies on, case by case."""

import pytest

from kv_manager import KVCacheManager, PoolExhausted
from kv_manager.prefix_hash import pack_tokens


def admit(kv: KVCacheManager, request_id: str, tokens: list[int], salt: bytes = b"") -> int:
    hit = kv.find_cached_prefix(tokens, salt)
    assert kv.allocate_slots(
        request_id, tokens, hit.num_tokens, len(tokens) - hit.num_tokens, hit, extra_key=salt
    ) is not None
    kv.cache_computed(request_id, tokens, len(tokens))
    return hit.num_tokens


def test_shared_prefix_reuses_blocks_and_counts_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert admit(kv, "a", list(range(10))) == 0
    assert admit(kv, "b", list(range(8)) + [99, 98, 97]) == 8
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.stats().hit_tokens == 8 and kv.stats().queried_tokens == 21


def test_blocks_are_found_only_once_their_content_is_computed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    assert kv.allocate_slots("a", tokens, 0, 9) is not None
    assert kv.find_cached_prefix(tokens).num_tokens == 0, "the step filling them has not run"
    kv.cache_computed("a", tokens, 5)
    assert kv.find_cached_prefix(tokens).num_tokens == 4
    kv.free("a")
    kv.cache_computed("a", tokens, 9)
    assert kv.find_cached_prefix(tokens).num_tokens == 4, "a freed request registers nothing"


def test_whole_prompt_hit_leaves_last_block_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, "a", list(range(8)))
    assert admit(kv, "b", list(range(8))) == 4


def test_freed_blocks_stay_cached_until_evicted_least_recently_used() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, "old", [1, 2, 3])
    admit(kv, "new", [7, 8, 9])
    kv.free("old")
    kv.free("new")
    # "old" freed first, so its blocks go first; "new"'s full block survives.
    admit(kv, "filler", [5, 5, 5])
    assert kv.find_cached_prefix([1, 2, 3]).num_tokens == 0
    assert kv.find_cached_prefix([7, 8, 9]).num_tokens == 2


def test_cache_salt_isolates_tenants() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, "a", list(range(9)), salt=b"tenant-a")
    assert kv.find_cached_prefix(list(range(9)), b"tenant-b").num_tokens == 0
    assert kv.find_cached_prefix(list(range(9)), b"tenant-a").num_tokens == 8


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    admit(kv, "a", list(range(8)))
    assert kv.allocate_slots("b", list(range(20, 29)), 0, 9) is None
    assert not kv.holds("b") and kv.num_free_blocks == 1
    assert kv.allocate_slots("a", list(range(8)), 8, 5) is None
    assert kv.block_ids("a") == [0, 1]


def test_a_block_each_at_once_is_what_one_allocation_each_gives() -> None:
    """Requests decoding past their last block get one more each, in order, as allocate_slots
    for each one's next token would give them; too few free blocks changes nothing."""
    at_once, one_by_one = KVCacheManager(num_blocks=6, block_size=4), KVCacheManager(num_blocks=6, block_size=4)
    for kv in (at_once, one_by_one):
        for request_id, first in (("a", 0), ("b", 100)):
            admit(kv, request_id, list(range(first, first + 8)))
    assert at_once.append_block_each(["b", "a"]) == [
        block for request_id in ("b", "a") for block in one_by_one.allocate_slots(request_id, [], 8, 1) or []
    ]
    assert at_once.block_ids("a") == one_by_one.block_ids("a") and at_once.block_ids("b") == one_by_one.block_ids("b")
    assert at_once.append_block_each(["a", "b"]) is None, "no block is free"
    assert at_once.block_ids("a") == one_by_one.block_ids("a") and at_once.stats() == one_by_one.stats()


def test_a_completed_block_given_packed_is_cached_as_its_token_list_would_be() -> None:
    """cache_next_blocks enters each request's block that its computed tokens just completed,
    from that block's packed tokens, as cache_computed from its token list does; a request
    whose earlier blocks are not all entered is handed back for cache_computed, untouched."""
    packed, listed = KVCacheManager(num_blocks=8, block_size=4), KVCacheManager(num_blocks=8, block_size=4)
    tokens = {"a": list(range(12)), "b": list(range(50, 62))}
    for kv in (packed, listed):
        for request_id, token_ids in tokens.items():
            kv.allocate_slots(request_id, token_ids, 0, 12)
            kv.cache_computed(request_id, token_ids, 4)
    # b's second block (4-8) was never entered: its third cannot be chained on yet.
    packed.cache_computed("a", tokens["a"], 8)
    listed.cache_computed("a", tokens["a"], 8)
    blocks = [pack_tokens(tokens["a"][8:12]), pack_tokens(tokens["b"][8:12])]
    assert packed.cache_next_blocks(["a", "b", "gone"], [12, 12, 12], [*blocks, b""]) == [1]
    assert packed.num_written("b") == 12 and packed.registered_hash("b", 1) is None
    listed.cache_computed("a", tokens["a"], 12)
    listed.cache_computed("b", tokens["b"], 4)
    assert packed.pool.cached_hashes() == listed.pool.cached_hashes()
    assert packed.num_written("a") == listed.num_written("a") == 12
    packed.cache_computed("b", tokens["b"], 12)
    listed.cache_computed("b", tokens["b"], 12)
    assert packed.pool.cached_hashes() == listed.pool.cached_hashes()
    assert admit(packed, "c", tokens["a"] + [7]) == 12


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(kv, "a", list(range(9)))
    assert admit(kv, "b", list(range(9))) == 0


def test_releasing_more_than_acquired_is_refused() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    admit(kv, "a", [1])
    block = kv.pool.blocks[kv.block_ids("a")[0]]
    kv.free("a")
    with pytest.raises(ValueError, match="released more often"):
        kv.pool.release([block])


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    kv.allocate_slots("a", prompt, 0, 10)
    kv.cache_computed("a", prompt, 10)
    parent = kv.block_ids("a")
    copy = kv.fork("a", "a#1", 9)
    child = kv.block_ids("a#1")
    assert child[:2] == parent[:2] and child[2] != parent[2]
    assert copy is not None and (copy.source, copy.destination) == (parent[2], child[2])
    assert [kv.pool.blocks[b].ref_count for b in parent] == [2, 2, 1]
    # The child computes on from the fork like any request: the last prompt token, then its own.
    assert kv.allocate_slots("a#1", [*prompt, 7], 9, 2) == []
    kv.free("a")
    assert [kv.pool.blocks[b].ref_count for b in child] == [1, 1, 1]


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", list(range(9)), 0, 9)
    kv.cache_computed("a", list(range(9)), 9)
    assert kv.fork("a", "b", 8) is None
    assert kv.block_ids("b") == kv.block_ids("a")[:2]


def test_fork_refuses_what_the_parent_has_not_written_and_a_full_pool() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", list(range(10)), 0, 10)
    with pytest.raises(ValueError, match="written 0 tokens"):
        kv.fork("a", "b", 9)
    kv.cache_computed("a", list(range(10)), 10)
    free = kv.num_free_blocks
    with pytest.raises(PoolExhausted):
        kv.fork("a", "b", 9)
    assert not kv.holds("b") and kv.num_free_blocks == free
