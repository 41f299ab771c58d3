"""The paged KV memory: per layer, K of [num_blocks * block_size, kv_heads, key_dim] and V of
[num_blocks * block_size, kv_heads, value_dim] (the two differ in multi-head latent attention)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from executor_service.attention import block_transfer

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        """0 for a model without attention layers (a pure state-space model), whose blocks only
        count tokens for the scheduler."""
        element = torch.empty((), dtype=self.dtype).element_size()
        per_token = self.num_kv_heads * (self.key_dim + self.value_dim) * element
        return self.num_layers * self.block_size * per_token

    def blocks_for_budget(self, budget_bytes: int, without_layers: int) -> int:
        """without_layers: the count for a model without attention layers, whose blocks cost
        nothing."""
        if self.num_layers == 0:
            return without_layers
        return max(0, budget_bytes // self.bytes_per_block())

    def layout(self) -> str:
        """ExecutorInfo.kv_layout: everything the bytes of a block depend on (block_transfer.py)."""
        # The dtype as ExecutorInfo.dtype names it.
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{dtype} layers={self.num_layers} kv_heads={self.num_kv_heads} "
            f"key_dim={self.key_dim} value_dim={self.value_dim} block_size={self.block_size}"
        )


class PagedKVCache:
    """Slot s of a layer holds the K/V of token s % block_size of block s // block_size.

    layer_ids: the model's indices of its attention layers, in order (shape.num_layers of them;
    0..num_layers-1 where None): a hybrid model's recurrent layers keep no K/V here."""

    def __init__(
        self, shape: KVCacheShape, num_blocks: int, device: torch.device, layer_ids: tuple[int, ...] | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        layer_ids = tuple(range(shape.num_layers)) if layer_ids is None else layer_ids
        if len(layer_ids) != shape.num_layers:
            raise ValueError(f"{len(layer_ids)} attention layer ids for a cache of {shape.num_layers} layers")
        self._position = {layer_id: position for position, layer_id in enumerate(layer_ids)}
        self.shape = shape
        self.device = device
        self.num_blocks = num_blocks
        slots = num_blocks * shape.block_size
        # One slot past the last block, in no block: the padded rows of a decode replayed from a
        # CUDA graph (decode_graphs.py) write their K/V there, where no request reads.
        self.scratch_slot = slots
        # Zeroed, not empty: padded gathers read unwritten slots, and NaN garbage there would
        # survive a masked softmax as NaN * 0.
        self.keys = [
            torch.zeros(slots + 1, shape.num_kv_heads, shape.key_dim, dtype=shape.dtype, device=device)
            for _ in range(shape.num_layers)
        ]
        self.values = [
            torch.zeros(slots + 1, shape.num_kv_heads, shape.value_dim, dtype=shape.dtype, device=device)
            for _ in range(shape.num_layers)
        ]
        self._gather = GatherScratch(shape.dtype, device, headroom_limit=self.keys[0].numel() if self.keys else 0)
        logger.info(
            "event=kv_cache_allocated blocks=%d block_size=%d bytes=%d device=%s",
            num_blocks,
            shape.block_size,
            num_blocks * shape.bytes_per_block(),
            device,
        )

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    def wipe(self) -> None:
        """Zeroes every slot (the scratch gathers too): nothing computed so far stays readable."""
        for tensor in (*self.keys, *self.values, self._gather.keys, self._gather.values):
            tensor.zero_()

    def copy_blocks(self, sources: list[int], destinations: list[int]) -> None:
        """Copies every slot of each source block into its destination block, in every layer
        (forks' copy-on-write; validation.copies_problem checked the ids)."""
        offsets = torch.arange(self.block_size, device=self.device)
        source_slots = (torch.tensor(sources, device=offsets.device)[:, None] * self.block_size + offsets).flatten()
        destination_slots = (torch.tensor(destinations, device=offsets.device)[:, None] * self.block_size + offsets).flatten()
        for tensor in (*self.keys, *self.values):
            tensor[destination_slots] = tensor[source_slots]

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """These blocks' K/V as KvBlockChunk.data carries them."""
        return block_transfer.read_blocks(self.keys, self.values, self.block_size, block_ids)

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        """Writes read_blocks' bytes of as many blocks into these; ValueError when they are
        not that many blocks' worth."""
        block_transfer.write_blocks(self.keys, self.values, self.block_size, block_ids, data)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of the model's layer layer_idx."""
        position = self._position[layer_idx]
        return self.keys[position], self.values[position]

    def gather_buffers(
        self, key_shape: tuple[int, ...], value_shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch K and V of these shapes for a decode gather, valid until the next call.

        Every layer of a step gathers the same shape and the next step only a little more, so
        one pair of buffers serves them all: no per-layer allocation of tens of MB (and its page
        faults on CPU). One layer's gather is already part of the CUDA budget (kv_budget).
        """
        return self._gather.take(key_shape, value_shape)


class GatherScratch:
    """A pair of flat buffers that only grow, handed out as views of the asked shape."""

    # Headroom on growth: contexts grow by one token a step, so an exact fit would reallocate
    # on nearly every step.
    GROWTH = 1.25

    def __init__(self, dtype: torch.dtype, device: torch.device, headroom_limit: int) -> None:
        self.dtype = dtype
        self.device = device
        # Growth headroom never goes past one layer's pool, what the CUDA budget reserves.
        self.headroom_limit = headroom_limit
        self.keys = torch.empty(0, dtype=dtype, device=device)
        self.values = torch.empty(0, dtype=dtype, device=device)

    def take(
        self, key_shape: tuple[int, ...], value_shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key_numel, value_numel = math.prod(key_shape), math.prod(value_shape)
        numel = max(key_numel, value_numel)
        if numel > self.keys.numel():
            capacity = max(numel, min(int(numel * self.GROWTH), self.headroom_limit))
            # Drop the old pair first so the peak is one pair, not two.
            self.keys = self.values = torch.empty(0)
            self.keys = torch.empty(capacity, dtype=self.dtype, device=self.device)
            self.values = torch.empty(capacity, dtype=self.dtype, device=self.device)
        return self.keys[:key_numel].view(key_shape), self.values[:value_numel].view(value_shape)
