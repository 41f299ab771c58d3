"""Checks a KV cache manager's books against themselves: every block is free (cached or not)
or held, and held by exactly the requests whose block tables name it; every state slot is free
or held by one request, and a hybrid model's requests hold a slot exactly while they hold blocks
(both are taken on admission and released together)."""

from collections import Counter
from collections.abc import Collection

from kv_manager.kv_cache_manager import KVCacheManager
from kv_manager.state_slots import StateSlotPool

# Mismatches listed per check before the rest are summarised: one bug tends to break many.
MAX_LISTED = 20


def pool_mismatches(manager: KVCacheManager) -> list[str]:
    """What is wrong with the pool's accounting, one line each; empty when nothing is."""
    pool = manager.pool
    tables = manager.block_tables()
    holders = Counter(block_id for blocks in tables.values() for block_id in blocks)
    free = set(pool.free_block_ids())
    found: list[str] = []
    for block in pool.blocks:
        held = holders.get(block.block_id, 0)
        if block.ref_count != held:
            owners = sorted(r for r, blocks in tables.items() if block.block_id in blocks)
            found.append(f"block {block.block_id}: reference count {block.ref_count}, but {held} block tables name it {owners}")
        if (block.ref_count == 0) != (block.block_id in free):
            state = "free" if block.block_id in free else "not free"
            found.append(f"block {block.block_id}: reference count {block.ref_count} yet {state}")
    for block_id in holders.keys() - {b.block_id for b in pool.blocks}:
        found.append(f"block {block_id}: named by a block table but outside the pool of {pool.num_blocks}")
    for block_hash, block_id in pool.cached_hashes().items():
        if pool.blocks[block_id].block_hash != block_hash:
            found.append(f"block {block_id}: indexed in the prefix cache under a hash it does not carry")
    found += state_slot_mismatches(manager.state_slots, tables.keys())
    if len(found) > MAX_LISTED:
        return found[:MAX_LISTED] + [f"... and {len(found) - MAX_LISTED} more"]
    return found


def state_slot_mismatches(slots: StateSlotPool, block_holders: Collection[str]) -> list[str]:
    """What is wrong with the state slots' accounting, one line each; block_holders are the
    requests holding blocks (the running ones), each of which needs a slot when the model has
    recurrent layers."""
    holders = slots.holders()
    free = slots.free_slots()
    free_set = set(free)
    everything = range(1, slots.num_slots + 1)
    found: list[str] = []
    owners: dict[int, list[str]] = {}
    for request_id, slot in sorted(holders.items()):
        owners.setdefault(slot, []).append(request_id)
    for slot, requests in sorted(owners.items()):
        if slot not in everything:
            found.append(f"state slot {slot}: held by {requests} but outside 1..{slots.num_slots}")
        if len(requests) > 1:
            found.append(f"state slot {slot}: held by {len(requests)} requests {requests}")
        if slot in free_set:
            found.append(f"state slot {slot}: held by {requests} yet free")
    for slot, count in sorted(Counter(free).items()):
        if slot not in everything:
            found.append(f"state slot {slot}: free but outside 1..{slots.num_slots}")
        if count > 1:
            found.append(f"state slot {slot}: free {count} times over")
    for slot in sorted(set(everything) - owners.keys() - free_set):
        found.append(f"state slot {slot}: neither held nor free")
    if slots.num_slots:
        for request_id in sorted(set(block_holders) - holders.keys()):
            found.append(f"request {request_id}: holds blocks but no state slot")
        for request_id in sorted(holders.keys() - set(block_holders)):
            found.append(f"request {request_id}: holds state slot {holders[request_id]} but no blocks")
    return found
