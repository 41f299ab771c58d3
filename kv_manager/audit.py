"""Checks a KV cache manager's books against themselves: every block is free (cached or not)
or held, and held by exactly the requests whose block tables name it."""

from collections import Counter

from kv_manager.kv_cache_manager import KVCacheManager

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
    if len(found) > MAX_LISTED:
        return found[:MAX_LISTED] + [f"... and {len(found) - MAX_LISTED} more"]
    return found
