"""The host tier (--kv-host-gib): a second set of per-layer K and V tensors in host memory, laid
out like the device cache's (host block b is slots [b * block_size, (b + 1) * block_size)),
into which a plan's swap-outs copy device blocks and from which its swap-ins copy them back.

On CUDA the host tensors are pinned, so the copies can run asynchronously: a swap-out waits for
its copies before the host tensors are written (the CPU does that scatter), while a swap-in's
upload is ordered before the forward by the stream they share, so it needs no wait.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from executor_service.attention.block_transfer import block_slots
from executor_service.attention.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)


class HostBlocks:
    """Host blocks [0, num_blocks). Pairs run in order, so where one plan names a target block
    twice, its last copy is what the block holds."""

    def __init__(self, cache: PagedKVCache, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self._cache = cache
        self.num_blocks = num_blocks
        self._pinned = cache.device.type == "cuda"
        slots = num_blocks * cache.block_size
        self.keys = [self._host_like(tensor, slots) for tensor in cache.keys]
        self.values = [self._host_like(tensor, slots) for tensor in cache.values]
        # Host blocks a swap-out has filled: a swap-in of any other would read K/V no plan put
        # there (a refused plan's, or the last holder's).
        self._filled = bytearray(num_blocks)
        # Blocks copied so far: out of the device, into it.
        self.swapped = [0, 0]
        logger.info(
            "event=kv_host_tier_allocated blocks=%d bytes=%d pinned=%s",
            num_blocks, num_blocks * cache.shape.bytes_per_block(), self._pinned,
        )

    def _host_like(self, tensor: torch.Tensor, slots: int) -> torch.Tensor:
        return torch.zeros(slots, *tensor.shape[1:], dtype=tensor.dtype, pin_memory=self._pinned)

    def unfilled(self, host_ids: Sequence[int], filled_first: Sequence[int]) -> int | None:
        """The first of host_ids that no swap-out has filled, counting filled_first (the same
        plan's swap-outs, which run before its swap-ins); None when all are filled."""
        first = set(filled_first)
        return next((b for b in host_ids if not self._filled[b] and b not in first), None)

    def forget(self, host_ids: Sequence[int]) -> None:
        """These blocks hold nothing a swap-in may read (swap-outs that were refused, or every
        block for a new holder)."""
        for block in host_ids:
            self._filled[block] = 0

    def forget_all(self) -> None:
        # Unreadable through any plan from now on: no need to zero gigabytes of host memory.
        self._filled = bytearray(self.num_blocks)

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        """Every slot of device block device_ids[i], in every layer, into host block host_ids[i]."""
        host_ids, device_ids = _last_copies(host_ids, device_ids)
        if not host_ids:
            return
        device = self._cache.device
        sources = block_slots(device_ids, self._cache.block_size, device)
        gathered = [tensor.index_select(0, sources) for tensor in (*self._cache.keys, *self._cache.values)]
        if self._pinned:
            staged = [torch.empty(part.shape, dtype=part.dtype, pin_memory=True) for part in gathered]
            for target, part in zip(staged, gathered, strict=True):
                target.copy_(part, non_blocking=True)
            # The CPU scatters them next: every download must have landed.
            torch.cuda.current_stream(device).synchronize()
            gathered = staged
        targets = block_slots(host_ids, self._cache.block_size, torch.device("cpu"))
        for tensor, part in zip((*self.keys, *self.values), gathered, strict=True):
            tensor.index_copy_(0, targets, part)
        for block in host_ids:
            self._filled[block] = 1
        self.swapped[0] += len(host_ids)

    def swap_in(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> None:
        """Every slot of host block host_ids[i], in every layer, into device block device_ids[i]."""
        device_ids, host_ids = _last_copies(device_ids, host_ids)
        if not device_ids:
            return
        device = self._cache.device
        sources = block_slots(host_ids, self._cache.block_size, torch.device("cpu"))
        targets = block_slots(device_ids, self._cache.block_size, device)
        for host, cached in zip((*self.keys, *self.values), (*self._cache.keys, *self._cache.values), strict=True):
            shape = (len(sources), *host.shape[1:])
            # Pinned, the upload below runs asynchronously; the pinned allocator keeps the buffer
            # until the copy that reads it is done.
            part = torch.index_select(host, 0, sources, out=torch.empty(shape, dtype=host.dtype, pin_memory=self._pinned))
            cached.index_copy_(0, targets, part.to(device, non_blocking=self._pinned))
        self.swapped[1] += len(device_ids)


def _last_copies(targets: Sequence[int], sources: Sequence[int]) -> tuple[list[int], list[int]]:
    """The pairs with each target once, copied from its last source: index_copy_ leaves a
    target named twice undefined."""
    last = dict(zip(targets, sources, strict=True))
    return list(last), list(last.values())

