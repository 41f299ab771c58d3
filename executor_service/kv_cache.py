"""The paged KV memory: per layer, K and V of [num_blocks * block_size, kv_heads, head_dim]."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        # K and V, every layer.
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_budget(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block())


class PagedKVCache:
    """Slot s of a layer holds the K/V of token s % block_size of block s // block_size."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        slots = num_blocks * shape.block_size
        # Zeroed, not empty: padded gathers read unwritten slots, and NaN garbage there would
        # survive a masked softmax as NaN * 0.
        self.keys = [
            torch.zeros(slots, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
            for _ in range(shape.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
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

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]
