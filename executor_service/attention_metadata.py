"""Per-step attention metadata: where each sequence's new K/V go and which slots it attends over.

Built once per step by plan_inputs and shared by every layer's attention call, so per-layer work
is only the cache write, the gather and the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from executor_service.kv_cache import PagedKVCache


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
    """All sequences with one new token, attended together over padded context."""

    token_index: torch.Tensor
    kv_slots: torch.Tensor
    context_lens: torch.Tensor
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """[batch, 1, 1, max_context] bool (True = attend)."""
        if window not in self.masks:
            key_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)[None, :]
            lens = self.context_lens[:, None]
            allowed = key_pos < lens
            if window is not None:
                allowed &= key_pos >= lens - window
            self.masks[window] = allowed[:, None, None, :]
        return self.masks[window]


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
    decodes: DecodeAttention | None
    varlen: VarlenAttention | None


def _context_slots(span: SequenceSpan, block_size: int, start: int, end: int) -> torch.Tensor:
    positions = torch.arange(start, end)
    blocks = torch.tensor(span.block_ids, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def build_step_attention(
    spans: list[SequenceSpan], kv_cache: PagedKVCache, backend: str, device: torch.device
) -> StepAttention:
    block_size = kv_cache.block_size
    slot_mapping = torch.cat(
        [_context_slots(s, block_size, s.num_cached, s.context_len) for s in spans]
    )
    context_slots = [_context_slots(s, block_size, 0, s.context_len) for s in spans]
    varlen = None
    prefills: list[PrefillAttention] = []
    decodes = None
    if backend == "flash_attn":
        varlen = VarlenAttention(
            kv_slots=torch.cat(context_slots).to(device),
            cu_seqlens_q=_cumulative([s.num_new for s in spans], device),
            cu_seqlens_k=_cumulative([s.context_len for s in spans], device),
            max_seqlen_q=max(s.num_new for s in spans),
            max_seqlen_k=max(s.context_len for s in spans),
        )
    else:
        decode_rows = [i for i, s in enumerate(spans) if s.num_new == 1]
        for i, span in enumerate(spans):
            if span.num_new > 1:
                prefills.append(
                    PrefillAttention(
                        token_start=span.token_start,
                        token_end=span.token_start + span.num_new,
                        num_cached=span.num_cached,
                        kv_slots=context_slots[i].to(device),
                    )
                )
        if decode_rows:
            padded = torch.nn.utils.rnn.pad_sequence(
                [context_slots[i] for i in decode_rows], batch_first=True
            )
            starts = [spans[i].token_start for i in decode_rows]
            lens = [spans[i].context_len for i in decode_rows]
            decodes = DecodeAttention(
                token_index=torch.tensor(starts, device=device),
                kv_slots=padded.to(device),
                context_lens=torch.tensor(lens, device=device),
            )
    return StepAttention(
        kv_cache=kv_cache,
        backend=backend,
        slot_mapping=slot_mapping.to(device),
        prefills=prefills,
        decodes=decodes,
        varlen=varlen,
    )


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    counts = torch.tensor([0, *lengths], dtype=torch.int32)
    return counts.cumsum(0, dtype=torch.int32).to(device)
