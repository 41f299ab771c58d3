"""The scheduler's books of an executor's host tier (--kv-host-gib): a second pool of K/V blocks,
in host memory, below the device's.

Two kinds of content live there: the K/V of requests preempted by swapping (held until they come
back, or end), and cached prefix blocks that left the device's prefix cache when their device
block was reused (a prefix cache of its own, least recently stored first out), which a later
prefix hit copies back instead of computing.

Nothing is copied here: each plan carries the copies its books imply (take_copies), and the
executor runs them before the step in a fixed order, swap-outs first. So a device block whose
content is swapped out may be reused by the same plan, and a host block that the plan reads is
held until the plan is made, never the target of the same plan's swap-outs.
"""

from dataclasses import dataclass, field

from kv_manager.block_pool import BlockPool, KVBlock
from kv_manager.prefix_hash import BlockHash


@dataclass(slots=True)
class TierCopies:
    """The copies of one plan: (device block, host block) out, then (host block, device block) in."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        # Swapped-out requests' host blocks, in token order.
        self._swapped: dict[str, list[KVBlock]] = {}
        self._copies = TierCopies()
        # Host blocks this plan reads, held until it is made.
        self._reading: list[KVBlock] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def swap_out(self, request_id: str, device_blocks: list[int]) -> bool:
        """Host blocks for a preempted request's blocks, copied out by the next plan; False,
        changing nothing, when the tier lacks room (cached prefix blocks give theirs up)."""
        if request_id in self._swapped:
            raise ValueError(f"request {request_id} is swapped out already")
        if len(device_blocks) > self.pool.num_free:
            return False
        host = self.pool.allocate(len(device_blocks))
        self._swapped[request_id] = host
        self._copies.swap_out += zip(device_blocks, (block.block_id for block in host), strict=True)
        return True

    def num_swapped(self, request_id: str) -> int:
        """Blocks the request has in the tier (0: it is not swapped out)."""
        return len(self._swapped.get(request_id, ()))

    def swap_in(self, request_id: str, device_blocks: list[int]) -> None:
        """Copies a swapped-out request's blocks back into these device blocks with the next
        plan; its host blocks are free once that plan is made."""
        host = self._swapped.pop(request_id)
        if len(host) != len(device_blocks):
            raise ValueError(f"request {request_id} has {len(host)} blocks swapped out, not {len(device_blocks)}")
        self._copies.swap_in += zip((block.block_id for block in host), device_blocks, strict=True)
        self._reading += host

    def drop(self, request_id: str) -> None:
        """A swapped-out request ended (or left): its host blocks are free."""
        host = self._swapped.pop(request_id, None)
        if host is not None:
            self.pool.release(host)

    def keep_evicted(self, block_hash: BlockHash, device_block: int) -> None:
        """A cached prefix block leaves the device (its block is reused): its content is copied
        into the tier, when the tier has room, under the same hash."""
        if self.pool.lookup(block_hash) is not None or not self.pool.num_free:
            return
        (block,) = self.pool.allocate(1)
        self.pool.register(block, block_hash)
        # Held by no one: the least recently stored cached block goes first when room is needed.
        self.pool.release([block])
        self._copies.swap_out.append((device_block, block.block_id))

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.pool.lookup(block_hash)

    def read_cached(self, blocks: list[KVBlock]) -> None:
        """A prefix hit on cached host blocks: held until the plan is made (before the device
        blocks they go into are allocated, whose evictions store into the tier)."""
        self.pool.acquire(blocks)
        self._reading += blocks

    def copy_back(self, block: KVBlock, device_block: int) -> None:
        """A held cached host block is copied into device_block by the next plan."""
        self._copies.swap_in.append((block.block_id, device_block))

    def take_copies(self) -> TierCopies:
        """The copies for the plan being made; the host blocks it reads are let go."""
        copies, self._copies = self._copies, TierCopies()
        self.pool.release(self._reading)
        self._reading = []
        return copies

    def swapped_tables(self) -> dict[str, list[int]]:
        """Every swapped-out request's host blocks (for the audit)."""
        return {request_id: [b.block_id for b in blocks] for request_id, blocks in self._swapped.items()}
