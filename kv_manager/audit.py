"""Checks a KV cache manager's books against themselves: every block is free (cached or not)
or held, and held by exactly the requests whose block tables name it; every state slot is free,
held by one request or lent to one checkpoint, a hybrid model's requests hold a slot exactly
while they hold blocks (both are taken on admission and released together), and a ready
checkpoint's block is in the prefix cache (it goes when its block does)."""

from collections import Counter
from collections.abc import Collection

from kv_manager.block_pool import BlockPool
from kv_manager.kv_cache_manager import KVCacheManager
from kv_manager.prefix_hash import BlockHash
from kv_manager.state_checkpoints import StateCheckpoints
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
    if manager.host is not None:
        found += host_tier_mismatches(manager.host.pool, manager.host.swapped_tables())
    found += checkpoint_mismatches(manager.checkpoints, manager.state_slots, pool.cached_hashes().keys())
    if len(found) > MAX_LISTED:
        return found[:MAX_LISTED] + [f"... and {len(found) - MAX_LISTED} more"]
    return found


def host_tier_mismatches(pool: BlockPool, swapped: dict[str, list[int]]) -> list[str]:
    """What is wrong with the host tier's accounting: between plans, a host block is held exactly
    by the swapped-out requests that name it (a cached prefix block in the tier is free)."""
    holders = Counter(block_id for blocks in swapped.values() for block_id in blocks)
    free = set(pool.free_block_ids())
    found = []
    for block in pool.blocks:
        if block.ref_count != holders.get(block.block_id, 0):
            found.append(f"host block {block.block_id}: reference count {block.ref_count}, but {holders.get(block.block_id, 0)} swapped requests name it")
        if (block.ref_count == 0) != (block.block_id in free):
            found.append(f"host block {block.block_id}: reference count {block.ref_count} yet {'free' if block.block_id in free else 'not free'}")
    return found


def state_slot_mismatches(slots: StateSlotPool, block_holders: Collection[str]) -> list[str]:
    """What is wrong with the state slots' accounting, one line each; block_holders are the
    requests holding blocks (the running ones), each of which needs a slot when the model has
    recurrent layers."""
    holders = slots.holders()
    free = slots.free_slots()
    free_set = set(free)
    lent = slots.lent_slots()
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
        if slot in lent:
            found.append(f"state slot {slot}: held by {requests} yet lent to a checkpoint")
    for slot, count in sorted(Counter(free).items()):
        if slot not in everything:
            found.append(f"state slot {slot}: free but outside 1..{slots.num_slots}")
        if count > 1:
            found.append(f"state slot {slot}: free {count} times over")
        if slot in lent:
            found.append(f"state slot {slot}: free yet lent to a checkpoint")
    for slot in sorted(lent - set(everything)):
        found.append(f"state slot {slot}: lent to a checkpoint but outside 1..{slots.num_slots}")
    for slot in sorted(set(everything) - owners.keys() - free_set - lent):
        found.append(f"state slot {slot}: neither held, lent nor free")
    if slots.num_slots:
        for request_id in sorted(set(block_holders) - holders.keys()):
            found.append(f"request {request_id}: holds blocks but no state slot")
        for request_id in sorted(holders.keys() - set(block_holders)):
            found.append(f"request {request_id}: holds state slot {holders[request_id]} but no blocks")
    return found


def checkpoint_mismatches(
    checkpoints: StateCheckpoints, slots: StateSlotPool, cached: Collection[BlockHash]
) -> list[str]:
    """What is wrong with the checkpoints' books, one line each: the slots they keep are
    exactly those the pool lent, one checkpoint each, and every ready one's block is among the
    cached hashes."""
    ready = checkpoints.ready()
    keepers = Counter([*ready.values(), *checkpoints.pending()])
    lent = slots.lent_slots()
    found: list[str] = []
    for slot, count in sorted(keepers.items()):
        if count > 1:
            found.append(f"state slot {slot}: keeps {count} checkpoints")
        if slot not in lent:
            found.append(f"state slot {slot}: keeps a checkpoint but is not lent to one")
    for slot in sorted(lent - keepers.keys()):
        found.append(f"state slot {slot}: lent to a checkpoint that does not keep it")
    cached = set(cached)
    for block_hash, slot in ready.items():
        if block_hash not in cached:
            found.append(f"state slot {slot}: keeps a ready checkpoint of block {block_hash.hex()}, which is not cached")
    return found
