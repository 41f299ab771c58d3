"""The C prefill kernel attends every prefill of a step as the written-out attention does, over
K/V it reads from the sequences' blocks (cached prefixes, chunk boundaries, windows, soft-caps,
sinks and grouped heads included); caches it cannot take keep their prefills on SDPA."""

from __future__ import annotations

import pytest
import torch

from executor_service.attention.attention_math import explicit_attention
from executor_service.attention.attention_metadata import (
    SequenceSpan,
    build_step_attention,
)
from executor_service.attention.kv_cache import KVCacheShape, PagedKVCache
from executor_service.attention.prefill_kernel import PrefillKernel, load_prefill_kernel

CPU = torch.device("cpu")
BLOCK = 16

from tests.helpers.c_kernels import load_or_skip


def _kernel_or_skip() -> PrefillKernel:
    return load_or_skip(load_prefill_kernel)


def _spans(shapes: list[tuple[int, int]], num_blocks: int, generator: torch.Generator) -> list[SequenceSpan]:
    """(new tokens, cached tokens) per sequence, in shuffled blocks, queries one after another."""
    order = torch.randperm(num_blocks, generator=generator).tolist()
    spans, token = [], 0
    for new, cached in shapes:
        count = -(-(new + cached) // BLOCK)
        spans.append(SequenceSpan(token, new, cached, tuple(order[:count])))
        order, token = order[count:], token + new
    return spans


@pytest.mark.parametrize(
    ("heads", "kv_heads", "key_dim", "value_dim", "window", "softcap", "sinks", "spread"),
    [
        (9, 3, 64, 64, None, None, False, 1.0),
        (8, 8, 128, 128, None, None, False, 1.0),
        (8, 2, 48, 32, 21, None, False, 1.0),
        (4, 1, 16, 16, None, 30.0, True, 1.0),
        (6, 3, 64, 80, 5, 50.0, True, 1.0),
        (8, 4, 64, 64, None, None, False, 40.0),
        (4, 2, 24, 12, None, None, False, 1.0),
    ],
)
# 1 thread runs every task in turn; 8 threads outnumber the tasks of the short sequences.
@pytest.mark.parametrize("threads", [1, 8])
def test_the_kernel_attends_as_the_written_out_attention_does(
    heads: int, kv_heads: int, key_dim: int, value_dim: int, window: int | None,
    softcap: float | None, sinks: bool, spread: float, threads: int,
) -> None:
    kernel = _kernel_or_skip()
    generator = torch.Generator().manual_seed(heads * key_dim + value_dim)
    # A whole prompt longer than a key chunk, chunks after a cached prefix (one ending mid
    # block), a two-token chunk, and a prompt of exactly one 64-key chunk.
    shapes = [(300, 0), (17, 40), (65, 100), (2, 0), (64, 0)]
    cache = PagedKVCache(KVCacheShape(1, kv_heads, key_dim, value_dim, BLOCK, torch.float32), 64, CPU)
    key_cache, value_cache = cache.layer(0)
    key_cache.copy_(torch.randn(key_cache.shape, generator=generator))
    value_cache.copy_(torch.randn(value_cache.shape, generator=generator))
    spans = _spans(shapes, cache.num_blocks, generator)
    step = build_step_attention(spans, cache, "cpu_paged", CPU)
    assert step.paged_prefill is not None and not step.prefills
    tokens = sum(new for new, _ in shapes)
    # Token rows strided as in the fused layers' packed QKV output.
    packed = torch.randn(tokens, (heads + 2 * kv_heads) * key_dim, generator=generator)
    queries = packed[:, : heads * key_dim].view(tokens, heads, key_dim)
    # spread 40: scores hundreds apart, so most weights underflow (kernels/softmax_exp.h).
    queries.mul_(spread)
    sink_logits = torch.randn(heads, generator=generator) if sinks else None
    scale = key_dim**-0.5
    got = torch.full((tokens, heads, value_dim), float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel(queries, key_cache, value_cache, step.paged_prefill, scale, window, softcap, sink_logits, got)
    finally:
        torch.set_num_threads(before)
    for span in spans:
        positions = torch.arange(span.context_len)
        slots = torch.tensor(span.block_ids)[positions // BLOCK] * BLOCK + positions % BLOCK
        query_pos = positions[span.num_cached :, None]
        allowed = positions[None, :] <= query_pos
        if window is not None:
            allowed &= positions[None, :] > query_pos - window
        rows = slice(span.token_start, span.token_start + span.num_new)
        # In float64: with scores hundreds apart (spread 40), float32 references round their
        # scores as differently from the kernel as the kernel does from the truth.
        expected = explicit_attention(
            queries[rows].transpose(0, 1).double(),
            key_cache[slots].transpose(0, 1).double(),
            value_cache[slots].transpose(0, 1).double(),
            allowed,
            scale,
            softcap,
            None if sink_logits is None else sink_logits.double(),
        ).transpose(0, 1)
        # Scores hundreds apart carry float32 rounding of ~1e-4 relative into the weights.
        tolerance = 1e-5 if spread == 1.0 else 1e-4
        torch.testing.assert_close(got[rows], expected.float(), rtol=1e-5, atol=tolerance)


def test_values_of_any_width_prefill_in_the_kernel() -> None:
    # DeepSeek-V3's values are narrower than its keys, and 12 wide in the test model: a width
    # the kernel once left to SDPA, whose prefill does not give the decode kernel's bits.
    generator = torch.Generator().manual_seed(0)
    cache = PagedKVCache(KVCacheShape(1, 2, 64, 12, BLOCK, torch.float32), 16, CPU)
    step = build_step_attention(_spans([(30, 0), (1, 5)], 16, generator), cache, "cpu_paged", CPU)
    assert step.paged_prefill is not None and not step.prefills and step.paged_decode is not None


def test_a_sequence_past_its_blocks_is_refused_before_the_kernel_reads() -> None:
    cache = PagedKVCache(KVCacheShape(1, 2, 64, 64, BLOCK, torch.float32), 16, CPU)
    short = SequenceSpan(0, 40, 0, (3, 4))
    with pytest.raises(RuntimeError, match="do not fit"):
        build_step_attention([short], cache, "cpu_paged", CPU)
    outside = SequenceSpan(0, 20, 0, (3, 16))
    with pytest.raises(RuntimeError, match="do not fit"):
        build_step_attention([outside], cache, "cpu_paged", CPU)


def test_the_kernel_refuses_tensors_it_cannot_read() -> None:
    kernel = _kernel_or_skip()
    cache = PagedKVCache(KVCacheShape(1, 2, 16, 16, BLOCK, torch.float32), 4, CPU)
    step = build_step_attention([SequenceSpan(0, 3, 0, (1,))], cache, "cpu_paged", CPU)
    assert step.paged_prefill is not None
    keys, values = cache.layer(0)
    out = torch.empty(3, 4, 16)
    with pytest.raises(ValueError, match="float32"):
        kernel(torch.zeros(3, 4, 16, dtype=torch.float64), keys, values, step.paged_prefill, 1.0, None, None, None, out)
    with pytest.raises(ValueError, match="KV heads"):
        kernel(torch.zeros(3, 3, 16), keys, values, step.paged_prefill, 1.0, None, None, None, out)
    with pytest.raises(ValueError, match="output"):
        kernel(torch.zeros(3, 4, 16), keys, values, step.paged_prefill, 1.0, None, None, None, out[:2])
