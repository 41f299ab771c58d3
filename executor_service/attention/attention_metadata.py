"""Per-step attention metadata: where each sequence's new K/V go and which slots it attends over.

Built once per step by plan_inputs and shared by every layer's attention call, so per-layer work
is only the cache write, the gather and the kernel.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from executor_service.attention.kv_cache import PagedKVCache


@dataclass(slots=True, frozen=True)
class SequenceSpan:
    """One sequence of the flattened batch: tokens [token_start, token_start + num_new) are its
    new queries at positions [num_cached, num_cached + num_new)."""

    token_start: int
    num_new: int
    num_cached: int
    block_ids: tuple[int, ...]

    @property
    def context_len(self) -> int:
        return self.num_cached + self.num_new


@dataclass(slots=True)
class PrefillAttention:
    """A sequence with several new tokens, attended on its own."""

    token_start: int
    token_end: int
    num_cached: int
    kv_slots: torch.Tensor
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[new, context] bool (True = attend); None means plain causal from position 0."""
        if window not in self.masks:
            context = self.kv_slots.shape[0]
            if self.num_cached == 0 and (window is None or window >= context):
                self.masks[window] = None
            else:
                device = self.kv_slots.device
                query_pos = torch.arange(self.num_cached, context, device=device)[:, None]
                key_pos = torch.arange(context, device=device)[None, :]
                allowed = key_pos <= query_pos
                if window is not None:
                    allowed &= key_pos > query_pos - window
                self.masks[window] = allowed
        return self.masks[window]


@dataclass(slots=True)
class DecodeAttention:
    """All sequences with one new token, attended together over padded context.

    The gather index addresses each layer's cache viewed as [slots * kv_heads, head_dim] and is
    ordered [batch, kv_heads, max_context], so one index_select yields K (or V) already in the
    contiguous head-major layout SDPA wants; gathering whole slots and transposing instead
    leaves a strided tensor that attention reads twice as slowly, and copying it is slower still.
    """

    token_index: torch.Tensor
    gather_index: torch.Tensor
    context_lens: torch.Tensor
    max_context: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # Gathers into the cache's shared scratch (PagedKVCache.gather_buffers), which moves when it
    # grows; a captured CUDA graph keeps the addresses it saw, so its gathers are its own.
    shared_scratch: bool = True

    @property
    def batch_size(self) -> int:
        return self.token_index.shape[0]

    def mask(self, window: int | None) -> torch.Tensor:
        """[batch, 1, 1, max_context] bool (True = attend)."""
        if window not in self.masks:
            key_pos = torch.arange(self.max_context, device=self.context_lens.device)[None, :]
            lens = self.context_lens[:, None]
            allowed = key_pos < lens
            if window is not None:
                allowed &= key_pos >= lens - window
            self.masks[window] = allowed[:, None, None, :]
        return self.masks[window]


@dataclass(slots=True, frozen=True)
class PagedDecode:
    """All sequences with one new token, for the decode kernel that reads K/V from their blocks:
    no padding and no grouping, each sequence attends over exactly its own context."""

    token_index: torch.Tensor
    # [batch, widest table] int64; short rows are padded with block 0, never read.
    block_table: torch.Tensor
    context_lens: torch.Tensor
    # The decodes are the step's tokens 0..batch-1 in order (a pure decode step), so the kernel
    # reads the queries and writes the output in place, with no gather and no scatter.
    whole_step: bool = False


@dataclass(slots=True, frozen=True)
class PagedPrefill:
    """All sequences with several new tokens, for the prefill kernel that reads K/V from their
    cache slots: sequence i's queries are tokens [token_start[i], + num_new[i]) at positions
    [num_cached[i], + num_new[i]), and its context position p lies in slots[slot_start[i] + p].
    Every tensor is int64 on the CPU."""

    token_start: torch.Tensor
    num_new: torch.Tensor
    num_cached: torch.Tensor
    slot_start: torch.Tensor
    slots: torch.Tensor


@dataclass(slots=True, frozen=True)
class VarlenAttention:
    """Flattened context of every sequence, for fused varlen kernels."""

    kv_slots: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(slots=True)
class StepAttention:
    kv_cache: PagedKVCache
    backend: str
    slot_mapping: torch.Tensor
    prefills: list[PrefillAttention]
    # Decode sequences in groups of similar context length (see group_by_context).
    decodes: list[DecodeAttention]
    varlen: VarlenAttention | None
    # Instead of `decodes` and `prefills`, with the cpu_paged backend.
    paged_decode: PagedDecode | None = None
    paged_prefill: PagedPrefill | None = None


def _context_slots(span: SequenceSpan, block_size: int, start: int, end: int) -> torch.Tensor:
    positions = torch.arange(start, end)
    blocks = torch.tensor(span.block_ids, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def _new_token_slots(spans: list[SequenceSpan], block_size: int) -> torch.Tensor:
    """Cache slot of every new token of the step, in flattened-batch order.

    Plain Python: a decode step has one new token per sequence, and a tensor round trip per
    sequence cost more than the arithmetic.
    """
    slots: list[int] = []
    for span in spans:
        blocks = span.block_ids
        slots.extend(
            blocks[pos // block_size] * block_size + pos % block_size
            for pos in range(span.num_cached, span.context_len)
        )
    return torch.tensor(slots, dtype=torch.long)


def decode_gather_index(
    table: torch.Tensor, max_context: int, block_size: int, num_kv_heads: int
) -> torch.Tensor:
    """DecodeAttention's gather index for a [batch, width] block table, on the table's device:
    the row of each (sequence, kv head, position < max_context) in the cache's layer viewed as
    [slots * kv_heads, head_dim], ordered [batch, kv_heads, max_context]."""
    positions = torch.arange(max_context, device=table.device)
    slots = table[:, positions // block_size] * block_size + positions % block_size
    heads = torch.arange(num_kv_heads, device=table.device)
    return (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()


def _decode_attention(
    spans: list[SequenceSpan], block_size: int, num_kv_heads: int, device: torch.device
) -> DecodeAttention:
    """One vectorised index for the whole decode batch instead of a slot tensor per sequence."""
    lens = [s.context_len for s in spans]
    max_context = max(lens)
    width = -(-max_context // block_size)
    table = torch.tensor([padded_blocks(s.block_ids, width) for s in spans], dtype=torch.long)
    return DecodeAttention(
        token_index=torch.tensor([s.token_start for s in spans], device=device),
        gather_index=decode_gather_index(table, max_context, block_size, num_kv_heads).to(device),
        context_lens=torch.tensor(lens, device=device),
        max_context=max_context,
    )


# A decode joins a group while its context is at least this share of the group's longest, so
# no sequence in a group is padded by more than 30 % of the group's length, at a few extra
# kernel calls per layer. bench.step_profile, decode steps of the throughput workload: 0.5 ->
# 85 ms, 0.7 -> 77 ms, 0.85 -> 74 ms (one group, i.e. 0: ~100 ms).
GROUP_MIN_SHARE = 0.7


def group_by_context(spans: list[SequenceSpan]) -> list[list[SequenceSpan]]:
    """Decode spans in groups attended together, longest contexts first. One padded batch of
    32 contexts between 32 and 640 tokens attends over about twice the keys it needs; grouping
    by length cuts the gather and the attention to what is there, plus the padding in a group."""
    groups: list[list[SequenceSpan]] = []
    for span in sorted(spans, key=lambda s: s.context_len, reverse=True):
        if groups and span.context_len >= GROUP_MIN_SHARE * groups[-1][0].context_len:
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


def _check_fits(spans: list[SequenceSpan], kv_cache: PagedKVCache) -> None:
    """The kernels read raw memory, so what they will read is checked here once per step (the
    executor's validation already refuses such plans; this keeps a bug from reading past the
    cache)."""
    for span in spans:
        if (
            len(span.block_ids) * kv_cache.block_size < span.context_len
            or max(span.block_ids) >= kv_cache.num_blocks
        ):
            raise RuntimeError(
                f"{span.context_len} tokens in blocks {span.block_ids[:8]}... "
                f"do not fit a cache of {kv_cache.num_blocks} blocks"
            )


def _paged_decode(spans: list[SequenceSpan], kv_cache: PagedKVCache, only_decodes: bool) -> PagedDecode:
    """only_decodes: the step has no prefill tokens."""
    _check_fits(spans, kv_cache)
    width = max(len(s.block_ids) for s in spans)
    starts = [s.token_start for s in spans]
    return PagedDecode(
        token_index=torch.tensor(starts),
        block_table=torch.tensor([padded_blocks(s.block_ids, width) for s in spans], dtype=torch.long),
        context_lens=torch.tensor([s.context_len for s in spans], dtype=torch.long),
        whole_step=only_decodes and starts == list(range(len(spans))),
    )


def _paged_prefill(spans: list[SequenceSpan], kv_cache: PagedKVCache) -> PagedPrefill:
    _check_fits(spans, kv_cache)
    slot_start = list(itertools.accumulate((s.context_len for s in spans[:-1]), initial=0))
    return PagedPrefill(
        token_start=torch.tensor([s.token_start for s in spans], dtype=torch.long),
        num_new=torch.tensor([s.num_new for s in spans], dtype=torch.long),
        num_cached=torch.tensor([s.num_cached for s in spans], dtype=torch.long),
        slot_start=torch.tensor(slot_start, dtype=torch.long),
        slots=torch.cat([_context_slots(s, kv_cache.block_size, 0, s.context_len) for s in spans]),
    )


def padded_blocks(block_ids: Sequence[int], width: int) -> list[int]:
    """The first `width` blocks, padded with block 0: padding (like any position past a
    sequence's context) is masked out, so whatever it reads is dropped."""
    blocks = list(block_ids[:width])
    return blocks + [0] * (width - len(blocks))


def build_step_attention(
    spans: list[SequenceSpan], kv_cache: PagedKVCache, backend: str, device: torch.device
) -> StepAttention:
    block_size = kv_cache.block_size
    varlen = None
    prefills: list[PrefillAttention] = []
    decodes: list[DecodeAttention] = []
    paged_decode = paged_prefill = None
    if backend == "flash_attn":
        context_slots = [_context_slots(s, block_size, 0, s.context_len) for s in spans]
        varlen = VarlenAttention(
            kv_slots=torch.cat(context_slots).to(device),
            cu_seqlens_q=_cumulative([s.num_new for s in spans], device),
            cu_seqlens_k=_cumulative([s.context_len for s in spans], device),
            max_seqlen_q=max(s.num_new for s in spans),
            max_seqlen_k=max(s.context_len for s in spans),
        )
    else:
        prefill_spans = [s for s in spans if s.num_new > 1]
        if backend == "cpu_paged" and prefill_spans:
            paged_prefill = _paged_prefill(prefill_spans, kv_cache)
            prefill_spans = []
        for span in prefill_spans:
            prefills.append(
                PrefillAttention(
                    token_start=span.token_start,
                    token_end=span.token_start + span.num_new,
                    num_cached=span.num_cached,
                    kv_slots=_context_slots(span, block_size, 0, span.context_len).to(device),
                )
            )
        decode_spans = [s for s in spans if s.num_new == 1]
        if backend == "cpu_paged" and decode_spans:
            only_decodes = not prefills and paged_prefill is None
            paged_decode = _paged_decode(decode_spans, kv_cache, only_decodes)
        else:
            decodes = [
                _decode_attention(group, block_size, kv_cache.shape.num_kv_heads, device)
                for group in group_by_context(decode_spans)
            ]
    return StepAttention(
        kv_cache=kv_cache,
        backend=backend,
        slot_mapping=_new_token_slots(spans, block_size).to(device),
        prefills=prefills,
        decodes=decodes,
        varlen=varlen,
        paged_decode=paged_decode,
        paged_prefill=paged_prefill,
    )


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    counts = torch.tensor([0, *lengths], dtype=torch.int32)
    return counts.cumsum(0, dtype=torch.int32).to(device)
