"""A query row's attention has the same bits whoever computes it: the decode kernel (one new
token) or the prefill kernel (the whole prompt at once, or chunked any way), alone or beside
other sequences, on one thread or many. Failover and preemption recompute a request's decoded
positions with a prefill; only this makes "no token changes" true by construction rather than
by luck at near-ties (DESIGN.md, "same bits whatever the batch")."""

from __future__ import annotations

import pytest
import torch

from executor_service.attention.attention_metadata import (
    SequenceSpan,
    build_step_attention,
)
from executor_service.attention.decode_kernel import DecodeKernel, load_decode_kernel
from executor_service.attention.kv_cache import KVCacheShape, PagedKVCache
from executor_service.attention.prefill_kernel import PrefillKernel, load_prefill_kernel
from tests.helpers.c_kernels import load_or_skip

CPU = torch.device("cpu")
BLOCK = 16
# The probe sequence's length: two whole key chunks of 64 and part of a third.
LENGTH = 150
# Other sequences' lengths, sharing the steps with the probe.
NEIGHBOURS = (7, 64, 65, 200, 33)


def _cache(kv_heads: int, key_dim: int, value_dim: int, generator: torch.Generator) -> PagedKVCache:
    cache = PagedKVCache(KVCacheShape(1, kv_heads, key_dim, value_dim, BLOCK, torch.float32), 64, CPU)
    for tensor in cache.layer(0):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return cache


def _tables(generator: torch.Generator) -> list[list[int]]:
    """Block tables of the probe (first) and its neighbours, in shuffled blocks."""
    order = torch.randperm(64, generator=generator).tolist()
    tables = []
    for length in (LENGTH, *NEIGHBOURS):
        count = -(-length // BLOCK)
        tables.append(order[:count])
        order = order[count:]
    return tables


class Probe:
    """The probe's last position through either kernel, in the company and chunking given."""

    def __init__(self, heads: int, kv_heads: int, key_dim: int, value_dim: int, window: int | None,
                 softcap: float | None, sinks: bool) -> None:
        generator = torch.Generator().manual_seed(heads * 1000 + key_dim + value_dim)
        self.prefill: PrefillKernel = load_or_skip(load_prefill_kernel)
        self.decode: DecodeKernel = load_or_skip(load_decode_kernel)
        self.cache = _cache(kv_heads, key_dim, value_dim, generator)
        self.tables = _tables(generator)
        lengths = (LENGTH, *NEIGHBOURS)
        # One query row per position of every sequence, whichever kernel reads it.
        self.queries = [torch.randn(length, heads, key_dim, generator=generator) for length in lengths]
        self.sinks = torch.randn(heads, generator=generator) if sinks else None
        self.window, self.softcap = window, softcap
        self.scale = key_dim**-0.5
        self.heads, self.value_dim = heads, value_dim

    def by_prefill(self, new: int, neighbours: bool) -> torch.Tensor:
        """The last `new` positions as one prefill chunk (the rest cached), beside each
        neighbour's last 9 positions when asked."""
        shapes = [(0, new)] + ([(i + 1, min(9, n)) for i, n in enumerate(NEIGHBOURS)] if neighbours else [])
        spans, rows, token = [], [], 0
        for sequence, count in shapes:
            length = len(self.queries[sequence])
            spans.append(SequenceSpan(token, count, length - count, tuple(self.tables[sequence])))
            rows.append(self.queries[sequence][length - count :])
            token += count
        step = build_step_attention(spans, self.cache, "cpu_paged", CPU)
        assert step.paged_prefill is not None
        out = torch.full((token, self.heads, self.value_dim), float("nan"))
        keys, values = self.cache.layer(0)
        self.prefill(torch.cat(rows), keys, values, step.paged_prefill, self.scale, self.window,
                     self.softcap, self.sinks, out)
        return out[new - 1]

    def by_decode(self, neighbours: bool) -> torch.Tensor:
        """The last position as a decode, alone or in a batch with every neighbour's last."""
        sequences = [0, *range(1, len(NEIGHBOURS) + 1)] if neighbours else [0]
        width = max(len(self.tables[s]) for s in sequences)
        table = torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in sequences])
        lengths = torch.tensor([len(self.queries[s]) for s in sequences])
        queries = torch.stack([self.queries[s][-1] for s in sequences])
        keys, values = self.cache.layer(0)
        out = self.decode(queries, keys, values, table, lengths, BLOCK, self.scale, self.window,
                          self.softcap, self.sinks)
        return out[0]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "key_dim", "value_dim", "window", "softcap", "sinks"),
    [
        (9, 3, 64, 64, None, None, False),
        (32, 8, 64, 64, None, None, False),
        (8, 8, 128, 128, None, None, False),
        (8, 2, 48, 32, 21, None, False),
        (4, 1, 16, 16, None, 30.0, True),
        (6, 3, 64, 80, 70, 50.0, True),
        (4, 2, 24, 12, None, None, False),
    ],
)
@pytest.mark.parametrize("threads", [1, 8])
def test_a_position_has_the_same_bits_decoded_or_prefilled_alone_or_batched(
    heads: int, kv_heads: int, key_dim: int, value_dim: int, window: int | None,
    softcap: float | None, sinks: bool, threads: int,
) -> None:
    probe = Probe(heads, kv_heads, key_dim, value_dim, window, softcap, sinks)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reference = probe.by_decode(neighbours=False)
        assert not reference.isnan().any()
        ways = {
            "decoded beside others": probe.by_decode(neighbours=True),
            "whole prompt prefilled": probe.by_prefill(LENGTH, neighbours=False),
            "prefilled beside others": probe.by_prefill(LENGTH, neighbours=True),
            "last 2 prefilled": probe.by_prefill(2, neighbours=False),
            "last 17 prefilled beside others": probe.by_prefill(17, neighbours=True),
            "last 87 prefilled": probe.by_prefill(87, neighbours=False),
        }
    finally:
        torch.set_num_threads(before)
    for way, got in ways.items():
        assert torch.equal(got, reference), f"{way}: max difference {(got - reference).abs().max().item():.3g}"
