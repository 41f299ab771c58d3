"""The scheduler's view of one executor's KV cache: per-request block tables and prefix reuse."""

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kv_manager import prefix_hash
from kv_manager.block_pool import BlockPool, KVBlock
from kv_manager.host_tier import HostTier, TierCopies
from kv_manager.prefix_hash import ROOT_HASH, BlockHash, extend_chain, hash_packed_block
from kv_manager.state_checkpoints import StateCheckpoints
from kv_manager.state_slots import StateSlotPool


@dataclass(slots=True)
class PrefixHit:
    """Leading full blocks of a prompt already in the cache, and the tokens they cover."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0
    # For a hybrid model: the slot of the checkpoint holding the recurrent state after those
    # tokens (KVCacheManager.resumable); 0 for a model without recurrent layers, or no hit.
    state_source_slot: int = 0
    # Cached blocks found in the host tier after `blocks` (their tokens are in num_tokens):
    # copied back into new device blocks when the hit is allocated.
    host_blocks: list[KVBlock] = field(default_factory=list)


class PoolExhausted(Exception):
    """No free block for what was asked; nothing was changed."""


@dataclass(slots=True, frozen=True)
class BlockCopy:
    """Copy-on-write of a shared partial block: the executor copies block `source` into
    `destination` before the step that writes into `destination` runs."""

    source: int
    destination: int


@dataclass(slots=True)
class CacheStats:
    num_blocks: int
    num_free_blocks: int
    queried_tokens: int
    hit_tokens: int
    # Recurrent-state slots (a hybrid model), and those no running request holds: free, or
    # keeping a checkpoint that a request may take, as free blocks include cached ones.
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    # Of hit_tokens, those copied back from the host tier; and its size and free blocks.
    host_hit_tokens: int = 0
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    num_registered: int = 0
    extra_key: bytes = b""
    # Leading tokens whose K/V the executor has written (reported by cache_computed; a fork's
    # from the start, as its copy runs before any plan made after it): what a fork may share.
    num_written: int = 0


class KVCacheManager:
    """Hands out block ids for requests' tokens and reuses blocks whose content is cached; for
    a hybrid model (num_state_slots > 0), also the recurrent-state slots its requests hold
    beside their blocks (state_slots: taken on admission, released with the blocks), and, with
    prefix caching, the checkpoints of cached prefixes' recurrent states that a prefix hit
    resumes from (checkpoints, in slots no request holds)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        num_host_blocks: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = StateSlotPool(num_state_slots)
        self.checkpoints = StateCheckpoints(self.state_slots)
        # The host tier below the device's blocks (a model without recurrent layers: a hybrid
        # model's cached prefix needs its recurrent state too, which the tier does not keep).
        self.host = HostTier(num_host_blocks) if num_host_blocks and not num_state_slots else None
        # A checkpoint is worth its slot only while a hit can reach its block; a cached block
        # leaving the device moves to the host tier.
        on_evict = self._evicted if num_state_slots or self.host is not None else None
        self.pool = BlockPool(num_blocks, on_evict=on_evict)
        self._requests: dict[str, _RequestBlocks] = {}
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._host_hit_tokens = 0

    def _evicted(self, block_hash: BlockHash, block_id: int) -> None:
        if self.state_slots.num_slots:
            self.checkpoints.forget(block_hash)
        if self.host is not None and self.enable_prefix_caching:
            self.host.keep_evicted(block_hash, block_id)

    def prefix_hashes(self, token_ids: Sequence[int], extra_key: bytes = b"") -> list[BlockHash]:
        """Hashes of the leading full blocks a prefix hit may cover (prefix_hash.cacheable_blocks)."""
        return prefix_hash.prefix_hashes(token_ids, self.block_size, extra_key)

    def find_cached_prefix(
        self,
        token_ids: Sequence[int],
        extra_key: bytes = b"",
        hashes: Sequence[BlockHash] | None = None,
    ) -> PrefixHit:
        """The longest run of leading full blocks found in the cache (never every token; see
        prefix_hashes). `hashes`, when given, are prefix_hashes(token_ids, extra_key) computed
        before, which spares hashing the prompt again."""
        if not self.enable_prefix_caching:
            return PrefixHit()
        hit = PrefixHit()
        for block_hash in self.prefix_hashes(token_ids, extra_key) if hashes is None else hashes:
            block = self.pool.lookup(block_hash)
            if block is not None and not hit.host_blocks:
                hit.blocks.append(block)
                continue
            # Past the device's run, only the host tier's (a run of either, in order).
            host_block = self.host.lookup(block_hash) if self.host is not None else None
            if host_block is None:
                break
            hit.host_blocks.append(host_block)
        hit.num_tokens = (len(hit.blocks) + len(hit.host_blocks)) * self.block_size
        return hit

    def resumable(self, hit: PrefixHit) -> PrefixHit:
        """The part of a prefix hit a request can resume from. A hybrid model's request needs
        the recurrent state after the cached tokens too: the hit is cut back to its longest
        run of blocks whose last has a ready checkpoint (none: no hit), which it names as
        state_source_slot. Any other model's hit is whole."""
        if not self.state_slots.num_slots:
            return hit
        for num_blocks in range(len(hit.blocks), 0, -1):
            block_hash = hit.blocks[num_blocks - 1].block_hash
            slot = self.checkpoints.slot(block_hash) if block_hash is not None else 0
            if slot:
                return PrefixHit(hit.blocks[:num_blocks], num_blocks * self.block_size, slot)
        return PrefixHit()

    def take_state_slot(self, request_id: str, keep: Collection[int] = ()) -> int:
        """A recurrent-state slot for a request being admitted (0 for a model without recurrent
        layers): a free one, else the least recently used checkpoint's outside keep (the slots
        the plan being made reads). Raises SlotsExhausted, changing nothing, when neither is."""
        return self.checkpoints.take_for_request(request_id, keep)

    def may_take_state_slot(self, keep: Collection[int] = ()) -> bool:
        """Whether take_state_slot would find a slot."""
        return not self.state_slots.num_slots or self.checkpoints.can_take(keep)

    def fill_checkpoint(self, slot: int, block_hash: BlockHash) -> bool:
        """The pending checkpoint in slot was made, for the prefix ending in the block named
        block_hash: ready, unless its block has left the prefix cache meanwhile or a checkpoint
        by that name is ready already (then its slot is freed; False)."""
        if self.pool.lookup(block_hash) is None:
            self.checkpoints.cancel(slot)
            return False
        return self.checkpoints.fill(slot, block_hash)

    def registered_hash(self, request_id: str, block_index: int) -> BlockHash | None:
        """The prefix-cache hash under which the request's block at block_index was entered
        (cache_computed), or None if it was not."""
        entry = self._requests.get(request_id)
        if entry is None or block_index >= entry.num_registered:
            return None
        return entry.hashes[block_index]

    def is_cached(self, block_hash: BlockHash) -> bool:
        """Whether a prefix hit would find the block (on the device, or in the host tier)."""
        if not self.enable_prefix_caching:
            return False
        return self.pool.lookup(block_hash) is not None or (self.host is not None and self.host.lookup(block_hash) is not None)

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        prefix_hit: PrefixHit | None = None,
        extra_key: bytes = b"",
        count_lookup: bool = True,
    ) -> list[int] | None:
        """Makes room for num_new_tokens after num_computed_tokens (which include prefix_hit's).
        count_lookup: a prompt's lookup, counted in the hit rate (a request arriving with its
        K/V reuses cached blocks too, but was looked up where it was admitted).

        Returns the ids of blocks appended to the request's table, or None, changing nothing,
        when the pool cannot hold them. The new blocks enter the prefix cache only once their
        content exists: see cache_computed.
        """
        entry = self._requests.get(request_id)
        hit = prefix_hit or PrefixHit()
        if entry is not None and hit.blocks:
            raise ValueError(f"request {request_id} already holds blocks; a prefix hit is for admission only")
        held = len(entry.blocks) if entry else 0
        needed = -(-(num_computed_tokens + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, needed - held - len(hit.blocks))
        revived = sum(1 for b in hit.blocks if b.ref_count == 0)
        if num_new_blocks + revived > self.pool.num_free:
            return None

        if entry is None:
            entry = self._requests[request_id] = _RequestBlocks(extra_key=extra_key)
        if prefix_hit is not None and count_lookup:
            self._queried_tokens += len(token_ids)
            self._hit_tokens += hit.num_tokens
            self._host_hit_tokens += len(hit.host_blocks) * self.block_size
        self.pool.acquire(hit.blocks)
        entry.blocks.extend(hit.blocks)
        if hit.host_blocks:
            assert self.host is not None
            self.host.read_cached(hit.host_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        entry.blocks.extend(new_blocks)
        # Their content is copied in before the plan's step runs, so they are cached now.
        for host_block, block in zip(hit.host_blocks, new_blocks, strict=False):
            assert self.host is not None and host_block.block_hash is not None
            self.host.copy_back(host_block, block.block_id)
            self.pool.register(block, host_block.block_hash)
        return [b.block_id for b in new_blocks]

    def append_block_each(self, request_ids: Sequence[str]) -> list[int] | None:
        """One more block at the end of each request's table, in order: what allocate_slots
        gives a request whose next token falls just past its blocks, for many requests at once
        (the steady decodes crossing a block boundary in one step). Returns the new blocks' ids,
        or None, changing nothing, when fewer blocks than requests are free."""
        if len(request_ids) > self.pool.num_free:
            return None
        blocks = self.pool.allocate(len(request_ids))
        for request_id, block in zip(request_ids, blocks, strict=True):
            self._requests[request_id].blocks.append(block)
        return [block.block_id for block in blocks]

    def cache_computed(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Enters the request's full blocks up to num_computed_tokens into the prefix cache.

        Called once the executor has written them: a block registered earlier could be handed to
        another request before (or without) its content being computed.
        """
        entry = self._requests.get(request_id)
        if entry is None:
            return
        entry.num_written = max(entry.num_written, num_computed_tokens)
        if not self.enable_prefix_caching:
            return
        num_full = min(len(token_ids), num_computed_tokens) // self.block_size
        self._register_full_blocks(entry, token_ids, min(num_full, len(entry.blocks)))

    def cache_next_blocks(
        self, request_ids: Sequence[str], num_computed: Sequence[int], packed_blocks: Sequence[bytes]
    ) -> list[int]:
        """cache_computed for requests whose computed tokens (num_computed) have just completed
        a block, given that block's tokens packed (prefix_hash.pack_tokens; a caller that holds
        them in an array packs them all at once), not the requests' token lists: a steady decode
        completes a block every block_size steps, and reading its list and hashing it cost more
        than the rest of its step. Returns the positions of requests whose registered blocks do
        not end just before that block (the caller enters those with cache_computed)."""
        unchained = []
        block_size, caching = self.block_size, self.enable_prefix_caching
        for position, request_id in enumerate(request_ids):
            entry = self._requests.get(request_id)
            if entry is None:
                continue
            computed = num_computed[position]
            if computed > entry.num_written:
                entry.num_written = computed
            index = computed // block_size - 1
            if not caching or entry.num_registered > index:
                continue
            hashes = entry.hashes
            if entry.num_registered < index or len(hashes) < index or len(entry.blocks) <= index:
                unchained.append(position)
                continue
            if len(hashes) == index:
                parent = hashes[-1] if index else ROOT_HASH
                hashes.append(hash_packed_block(parent, packed_blocks[position], entry.extra_key))
            self.pool.register(entry.blocks[index], hashes[index])
            entry.num_registered = index + 1
        return unchained

    def num_written(self, request_id: str) -> int:
        """Leading tokens of the request whose K/V exists on the executor (0 if it holds none)."""
        entry = self._requests.get(request_id)
        return entry.num_written if entry else 0

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> BlockCopy | None:
        """Gives child_id the parent's K/V of its first num_tokens tokens (which must be
        written, see num_written) without computing them again: the full blocks are shared
        (one more holder each), and a partial last block, which the child is about to write
        into, is copied on that write into a block of its own (the returned BlockCopy, for the
        executor). The child then computes on from num_tokens like any request.

        Raises ValueError when the parent has not written that far or the child holds blocks,
        or the model keeps recurrent state (the parent's after num_tokens is not kept to copy);
        PoolExhausted, changing nothing, when the copy needs a block and none is free."""
        if self.state_slots.num_slots:
            raise ValueError("a hybrid model's request cannot fork: the recurrent state to share is not kept")
        parent = self._requests.get(parent_id)
        if parent is None or parent.num_written < num_tokens:
            written = parent.num_written if parent else 0
            raise ValueError(f"request {parent_id} has written {written} tokens, not {num_tokens}")
        if child_id in self._requests:
            raise ValueError(f"request {child_id} already holds blocks")
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and self.pool.num_free == 0:
            raise PoolExhausted("no free block for the copy of the shared partial block")
        shared = parent.blocks[:num_full]
        self.pool.acquire(shared)
        child = self._requests[child_id] = _RequestBlocks(
            blocks=list(shared),
            hashes=parent.hashes[:num_full],
            num_registered=min(parent.num_registered, num_full),
            extra_key=parent.extra_key,
            num_written=num_tokens,
        )
        if not partial:
            return None
        (copy,) = self.pool.allocate(1)
        child.blocks.append(copy)
        return BlockCopy(parent.blocks[num_full].block_id, copy.block_id)

    def keep_tokens(self, request_id: str, num_tokens: int) -> int:
        """Releases the request's blocks past those that hold its first num_tokens tokens (the
        blocks of drafts the executor rejected, which held nothing else); returns how many.
        Those blocks were never entered into the prefix cache (cache_computed stops at computed
        tokens), so they join the free queue as plain free blocks."""
        entry = self._requests.get(request_id)
        if entry is None:
            return 0
        keep = -(-num_tokens // self.block_size)
        extra = entry.blocks[keep:]
        if not extra:
            return 0
        if keep < entry.num_registered:
            raise ValueError(f"request {request_id}: block {keep} is cached and holds computed tokens")
        del entry.blocks[keep:]
        self.pool.release(reversed(extra))
        return len(extra)

    def free(self, request_id: str) -> None:
        """Releases every block of the request (in the host tier too), and its state slot
        (finished, aborted or preempted: whenever it leaves the executor, its state there
        goes). Idempotent."""
        self._release_device(request_id)
        if self.host is not None:
            self.host.drop(request_id)

    def _release_device(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.pool.release(reversed(entry.blocks))
        self.state_slots.free(request_id)

    def swap_out(self, request_id: str, num_tokens: int) -> bool:
        """Preemption by swapping: the request's blocks holding its first num_tokens tokens are
        copied into the host tier by the next plan, and its device blocks are freed (that plan
        may reuse them). False, changing nothing, without a tier or room in it."""
        entry = self._requests.get(request_id)
        if self.host is None or entry is None or num_tokens <= 0:
            return False
        kept = [block.block_id for block in entry.blocks[: -(-num_tokens // self.block_size)]]
        if not self.host.swap_out(request_id, kept):
            return False
        self._release_device(request_id)
        return True

    def is_swapped(self, request_id: str) -> bool:
        return self.host is not None and self.host.num_swapped(request_id) > 0

    def swap_in(self, request_id: str, extra_key: bytes = b"", num_tokens: int = 0) -> bool:
        """Device blocks for a swapped-out request, its K/V copied back into them by the next
        plan; False, changing nothing, when too few are free for them and for num_tokens
        tokens in all (what it computes next, so it never waits holding blocks)."""
        assert self.host is not None
        count = self.host.num_swapped(request_id)
        if request_id in self._requests:
            raise ValueError(f"request {request_id} already holds blocks")
        if max(count, -(-num_tokens // self.block_size)) > self.pool.num_free:
            return False
        blocks = self.pool.allocate(count)
        self._requests[request_id] = _RequestBlocks(blocks=blocks, extra_key=extra_key)
        self.host.swap_in(request_id, [block.block_id for block in blocks])
        return True

    def take_tier_copies(self) -> TierCopies:
        """The host tier's copies for the plan being made (none without a tier)."""
        return self.host.take_copies() if self.host is not None else TierCopies()

    def rename(self, request_id: str, owner: str) -> None:
        """Moves the request's blocks and state slot, as they are, under another owner's name
        (what is offered to another executor stays held under the move's name while the
        request leaves)."""
        if owner in self._requests:
            raise ValueError(f"{owner!r} already holds blocks")
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self._requests[owner] = entry
        self.state_slots.rename(request_id, owner)

    def block_ids(self, request_id: str) -> list[int]:
        entry = self._requests.get(request_id)
        return [b.block_id for b in entry.blocks] if entry else []

    def block_tables(self) -> dict[str, list[int]]:
        """Every request's block ids (for the audit)."""
        return {request_id: [b.block_id for b in entry.blocks] for request_id, entry in self._requests.items()}

    def holds(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content the prefix cache can hand out (held or evictable)."""
        return self.pool.num_cached

    def stats(self) -> CacheStats:
        return CacheStats(
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free,
            queried_tokens=self._queried_tokens,
            hit_tokens=self._hit_tokens,
            num_state_slots=self.state_slots.num_slots,
            num_free_state_slots=self.state_slots.num_slots - self.state_slots.num_held,
            host_hit_tokens=self._host_hit_tokens,
            num_host_blocks=self.host.num_blocks if self.host is not None else 0,
            num_free_host_blocks=self.host.pool.num_free if self.host is not None else 0,
        )

    def _register_full_blocks(
        self, entry: _RequestBlocks, token_ids: Sequence[int], num_full: int
    ) -> None:
        if num_full <= entry.num_registered:
            return
        extend_chain(entry.hashes, token_ids, self.block_size, num_full, entry.extra_key)
        for index in range(entry.num_registered, num_full):
            self.pool.register(entry.blocks[index], entry.hashes[index])
        entry.num_registered = num_full
