"""Turns the scheduled work of one step into the tensors of one flattened forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.attention.attention_metadata import (
    SequenceSpan,
    StepAttention,
    build_step_attention,
)
from executor_service.attention.kv_cache import PagedKVCache
from executor_service.model.sequence_rope import token_lengths
from executor_service.runner.request_state import RequestState


@dataclass(slots=True, frozen=True)
class ScheduledWork:
    state: RequestState
    num_tokens: int

    @property
    def samples(self) -> bool:
        """A token is sampled when this step's computation reaches the end of the known tokens."""
        return self.state.num_computed_tokens + self.num_tokens == len(self.state.token_ids)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: StepAttention
    # Flattened-batch index of the last token of each sampling request, in work order.
    logits_indices: torch.Tensor
    sampled: list[RequestState]
    # Each token's sequence length as transformers' generate sees it (sequence_rope.py); only
    # for models whose rotary frequencies depend on it.
    rope_lengths: torch.Tensor | None = None


def build_step_inputs(
    work: list[ScheduledWork],
    kv_cache: PagedKVCache,
    backend: str,
    device: torch.device,
    rope_lengths: bool = False,
) -> StepInputs:
    token_ids: list[int] = []
    lengths: list[int] = []
    positions: list[int] = []
    spans: list[SequenceSpan] = []
    logits_indices: list[int] = []
    sampled: list[RequestState] = []
    for item in work:
        start = item.state.num_computed_tokens
        end = start + item.num_tokens
        spans.append(
            SequenceSpan(
                token_start=len(token_ids),
                num_new=item.num_tokens,
                num_cached=start,
                block_ids=tuple(item.state.block_ids),
            )
        )
        token_ids.extend(item.state.token_ids[start:end])
        positions.extend(range(start, end))
        if rope_lengths:
            lengths.extend(token_lengths(item.state.num_prompt_tokens, start, end))
        if item.samples:
            logits_indices.append(len(token_ids) - 1)
            sampled.append(item.state)
    return StepInputs(
        input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        attention=build_step_attention(spans, kv_cache, backend, device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        sampled=sampled,
        rope_lengths=torch.tensor(lengths, dtype=torch.long, device=device) if rope_lengths else None,
    )
