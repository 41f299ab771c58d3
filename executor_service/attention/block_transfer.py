"""Blocks' K/V as bytes, for moving them to another executor (KvTransfer.FetchBlocks).

The bytes of some blocks are, for each attention layer in order, the blocks' K slots then their
V slots, raw in the cache dtype: what KvBlockChunk.data carries. Two executors whose kv_layout
strings are equal read each other's bytes the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_slots(block_ids: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    """The cache rows of these blocks, block by block (slot s is in block s // block_size)."""
    offsets = torch.arange(block_size, device=device)
    return (torch.tensor(list(block_ids), dtype=torch.int64, device=device)[:, None] * block_size + offsets).flatten()


def read_blocks(
    keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, block_ids: list[int]
) -> bytes:
    """The bytes of these blocks, in this order."""
    if not keys:
        return b""
    slots = block_slots(block_ids, block_size, keys[0].device)
    parts = [tensor[slots].reshape(-1) for layer in zip(keys, values) for tensor in layer]
    # uint8 views: numpy has no bfloat16, and bytes are all that travel.
    return torch.cat(parts).view(torch.uint8).cpu().numpy().tobytes()


def write_blocks(
    keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, block_ids: list[int], data: bytes
) -> None:
    """Writes read_blocks' bytes of as many blocks into these blocks; ValueError, writing
    nothing, when the bytes are not that many blocks' worth."""
    num_slots = len(block_ids) * block_size
    tensors = [tensor for layer in zip(keys, values) for tensor in layer]
    sizes = [num_slots * tensor[0].numel() for tensor in tensors]
    expected = sum(size * tensor.element_size() for size, tensor in zip(sizes, tensors))
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes are not the K/V of {len(block_ids)} blocks ({expected} bytes)")
    if not data:
        return
    device, dtype = keys[0].device, keys[0].dtype
    # A writable copy: torch.frombuffer over immutable bytes warns, and the copy is the upload's anyway.
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).to(device)
    slots = block_slots(block_ids, block_size, device)
    for tensor, part in zip(tensors, flat.split(sizes), strict=True):
        tensor[slots] = part.view(num_slots, *tensor.shape[1:])
