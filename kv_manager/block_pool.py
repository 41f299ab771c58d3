"""The pool of KV blocks: reference counts, the free queue and the prefix-cache index."""

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kv_manager.prefix_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and registered in the prefix cache; kept after the block is freed
    # so a later request can revive it, cleared when the block is evicted for reuse.
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every KVBlock. Free blocks wait in eviction order: least recently freed first."""

    def __init__(self, num_blocks: int, on_evict: Callable[[BlockHash, int], None] | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        # Told each hash that leaves the prefix cache, with the block that held it (what was kept
        # for that prefix goes too, or moves to a lower tier).
        self._on_evict = on_evict
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        # Blocks handed out fresh, and blocks whose last holder let go, since the pool began
        # (the step trace's per-step allocation and release counts are their differences).
        self.num_allocated = 0
        self.num_released = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks not held by any request, cached ones included (they can be evicted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """Takes count blocks off the front of the free queue, evicting their cached content."""
        if count > len(self._free):
            raise ValueError(f"asked for {count} blocks, {len(self._free)} free")
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        self.num_allocated += count
        return taken

    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """Adds a holder to blocks found in the prefix cache, reviving freed ones."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drops a holder; blocks nobody holds join the back of the free queue.

        Callers pass a request's blocks last-first, so a freed prefix's tail is evicted before
        its head, which other prompts are likelier to share.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"block {block.block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                self.num_released += 1

    def register(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Indexes a full block by its content hash. A block already indexed under that hash
        wins: this one stays a private duplicate and is freed like any unhashed block."""
        if block.block_hash is not None:
            return
        if block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and diagnostics)."""
        return list(self._free)

    def cached_hashes(self) -> dict[BlockHash, int]:
        """Prefix-cache index as hash -> block id (for tests and diagnostics)."""
        return {h: b.block_id for h, b in self._cached.items()}

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self._on_evict is not None:
                self._on_evict(block.block_hash, block.block_id)
            block.block_hash = None
