"""Blocks' K/V as bytes (attention/block_transfer.py): what one cache reads, another of the same
layout writes into other blocks, bit for bit, in any dtype and with keys wider than values."""

from __future__ import annotations

import pytest
import torch

from executor_service.attention.kv_cache import KVCacheShape, PagedKVCache

CPU = torch.device("cpu")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")),
]


def _filled(shape: KVCacheShape, num_blocks: int, seed: int, device: torch.device = CPU) -> PagedKVCache:
    cache = PagedKVCache(shape, num_blocks, device)
    generator = torch.Generator().manual_seed(seed)
    for tensor in (*cache.keys, *cache.values):
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(shape.dtype))
    return cache


def _block(tensor: torch.Tensor, block: int, block_size: int) -> torch.Tensor:
    return tensor[block * block_size : (block + 1) * block_size]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_read_from_one_cache_are_written_bit_for_bit_into_others(dtype: torch.dtype, device: str) -> None:
    shape = KVCacheShape(num_layers=3, num_kv_heads=2, key_dim=8, value_dim=4, block_size=4, dtype=dtype)
    # Both caches on the device: the bytes between them pass through the host, as they travel.
    source = _filled(shape, num_blocks=8, seed=1, device=torch.device(device))
    destination = _filled(shape, num_blocks=8, seed=2, device=torch.device(device))
    untouched = [tensor.clone() for tensor in (*destination.keys, *destination.values)]
    data = source.read_blocks([5, 1, 6])
    assert len(data) == 3 * shape.bytes_per_block()
    destination.write_blocks([0, 7, 3], data)
    for layer in range(shape.num_layers):
        for theirs, ours in ((source.keys[layer], destination.keys[layer]), (source.values[layer], destination.values[layer])):
            for read, written in ((5, 0), (1, 7), (6, 3)):
                assert torch.equal(_block(theirs, read, 4).view(torch.uint8), _block(ours, written, 4).view(torch.uint8))
    # Blocks not written, and the scratch slot past the last block, keep what they held.
    for tensor, before in zip((*destination.keys, *destination.values), untouched, strict=True):
        for block in (1, 2, 4, 5, 6):
            assert torch.equal(_block(tensor, block, 4), _block(before, block, 4))
        assert torch.equal(tensor[-1], before[-1])


def test_bytes_of_another_block_count_are_refused_and_nothing_is_written() -> None:
    shape = KVCacheShape(num_layers=2, num_kv_heads=1, key_dim=4, value_dim=4, block_size=2, dtype=torch.float32)
    cache = _filled(shape, num_blocks=4, seed=3)
    before = [tensor.clone() for tensor in (*cache.keys, *cache.values)]
    with pytest.raises(ValueError, match="not the K/V of 2 blocks"):
        cache.write_blocks([0, 1], cache.read_blocks([2]))
    assert all(torch.equal(t, b) for t, b in zip((*cache.keys, *cache.values), before, strict=True))


def test_the_layout_names_everything_the_bytes_depend_on() -> None:
    shape = KVCacheShape(num_layers=30, num_kv_heads=3, key_dim=64, value_dim=64, block_size=16, dtype=torch.float32)
    assert shape.layout() == "float32 layers=30 kv_heads=3 key_dim=64 value_dim=64 block_size=16"
