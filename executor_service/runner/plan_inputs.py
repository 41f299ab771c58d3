"""Turns the scheduled work of one step into the tensors of one flattened forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from executor_service.attention.attention_metadata import (
    PagedDecode,
    SequenceSpan,
    StepAttention,
    build_step_attention,
)
from executor_service.attention.kv_cache import PagedKVCache
from executor_service.model.sequence_rope import token_lengths
from executor_service.recurrent.recurrent_step import (
    RecurrentStep,
    SequenceWork,
    build_recurrent_step,
)
from executor_service.runner.request_rows import (
    RequestRows,
    RequestState,
)
from executor_service.runner.steady_decodes import SteadyStep


@dataclass(slots=True, frozen=True)
class ScheduledWork:
    state: RequestState
    num_tokens: int
    # The tokens the step may sample (NewRequest.allowed_token_bitmask); empty: any.
    allowed_token_bitmask: bytes = b""
    # They come after the plan (ContinuingRequest.bitmask_follows).
    bitmask_follows: bool = False
    # (n, slot): keep the recurrent state after the first n of these tokens in slot
    # (StepPlan.state_checkpoints).
    checkpoints: tuple[tuple[int, int], ...] = ()
    # Tokens proposed to follow the request's (ContinuingRequest.draft_token_ids): the step
    # computes them after its last token, num_tokens counting them, and samples at each.
    draft_token_ids: tuple[int, ...] = ()
    # Drafts the draft model proposes (ContinuingRequest.num_model_drafts), which the step puts
    # in draft_token_ids before its forward.
    num_model_drafts: int = 0
    # The tokens the position after each draft may sample (ContinuingRequest.draft_bitmasks).
    draft_bitmasks: tuple[bytes, ...] = ()

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids) or self.num_model_drafts

    @property
    def samples(self) -> bool:
        """A token is sampled when this step's computation reaches the end of the known tokens
        (and of the drafts after them)."""
        return self.state.num_computed_tokens + self.num_tokens - self.num_drafts == self.state.num_tokens

    @property
    def num_samples(self) -> int:
        """Rows the step samples for it: one per computed position from its last known token on
        (that token's, then each draft's), none when it does not reach its end."""
        return 1 + self.num_drafts if self.samples else 0


@dataclass(slots=True, frozen=True)
class PromptSpan:
    """Prompt positions of one request whose logits the step computes to score the tokens after
    them (want_prompt_logprobs): positions first .. first + count - 1 score tokens first + 1 ..."""

    state: RequestState
    first: int
    count: int


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: StepAttention
    # Flattened-batch index of the last token of each sampling request, in work order; of its
    # last token and each of its drafts for a request with drafts (ScheduledWork.num_samples).
    logits_indices: torch.Tensor
    # Per sampled row, its request (repeated for each row of a request with drafts).
    sampled: list[RequestState]
    # The sampled requests' rows (RequestRows), and per row whether only its argmax is read.
    sampled_rows: np.ndarray
    argmax_only: list[bool]
    # Each token's sequence length as transformers' generate sees it (sequence_rope.py); only
    # for models whose rotary frequencies depend on it.
    rope_lengths: torch.Tensor | None = None
    # Prompts scored this step: their rows follow the sampled ones in logits_indices.
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    # How the step's tokens split into recurrent mixers' calls; None for a model without them.
    recurrent: RecurrentStep | None = None


def build_step_inputs(
    work: list[ScheduledWork],
    kv_cache: PagedKVCache,
    backend: str,
    device: torch.device,
    rope_lengths: bool = False,
    recurrent: bool = False,
) -> StepInputs:
    """recurrent: the model has recurrent layers, which need the step split by sequence."""
    token_ids: list[int] = []
    lengths: list[int] = []
    positions: list[int] = []
    spans: list[SequenceSpan] = []
    logits_indices: list[int] = []
    sampled: list[RequestState] = []
    # Per sampled request, whether the plan restricts its tokens: then every logit is read.
    masked: list[bool] = []
    prompt_spans: list[PromptSpan] = []
    prompt_indices: list[int] = []
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
        # Drafts follow the request's known tokens, as a prefill chunk's tokens would.
        token_ids.extend(item.state.tokens(start, end - len(item.draft_token_ids)))
        token_ids.extend(item.draft_token_ids)
        positions.extend(range(start, end))
        if rope_lengths:
            lengths.extend(token_lengths(item.state.num_prompt_tokens, start, end))
        rows = item.num_samples
        if rows:
            logits_indices.extend(range(len(token_ids) - rows, len(token_ids)))
            sampled.extend([item.state] * rows)
            masked.extend([bool(item.allowed_token_bitmask) or item.bitmask_follows] * rows)
        if item.state.sampling.want_prompt_logprobs:
            # Position p scores prompt token p + 1; the last prompt position is the sampled row.
            scored = min(end, item.state.num_prompt_tokens - 1) - start
            if scored > 0:
                prompt_spans.append(PromptSpan(item.state, start, scored))
                first_index = len(token_ids) - item.num_tokens
                prompt_indices.extend(range(first_index, first_index + scored))
    sampled_rows = np.array([state.row for state in sampled], dtype=np.int64)
    argmax_only = sampled[0].rows.argmax_only(sampled_rows) if sampled else []
    if any(masked):
        argmax_only = [only and not mask for only, mask in zip(argmax_only, masked, strict=True)]
    logits_indices.extend(prompt_indices)
    argmax_only = argmax_only + [False] * len(prompt_indices)
    return StepInputs(
        input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        attention=build_step_attention(spans, kv_cache, backend, device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        sampled=sampled,
        sampled_rows=sampled_rows,
        argmax_only=argmax_only,
        rope_lengths=torch.tensor(lengths, dtype=torch.long, device=device) if rope_lengths else None,
        prompt_spans=prompt_spans,
        recurrent=_recurrent_step(work, spans, device) if recurrent else None,
    )


def _recurrent_step(work: list[ScheduledWork], spans: list[SequenceSpan], device: torch.device) -> RecurrentStep:
    sequences = [
        SequenceWork(span.token_start, span.num_new, span.num_cached, item.state.state_slot, item.checkpoints)
        for item, span in zip(work, spans, strict=True)
    ]
    return build_recurrent_step(sequences, device)


def build_decode_inputs(rows: RequestRows, step: SteadyStep, kv_cache: PagedKVCache) -> StepInputs:
    """A step of steady decodes for the cpu_paged backend, from the inputs SteadyDecodes
    gathered: one token per request, its last, each sampled. The same inputs build_step_inputs
    makes of these requests, at a cost that does not grow with their contexts."""
    return StepInputs(
        input_ids=torch.from_numpy(step.last_tokens),
        position_ids=torch.from_numpy(step.positions),
        attention=StepAttention(
            kv_cache=kv_cache,
            backend="cpu_paged",
            slot_mapping=torch.from_numpy(step.slots),
            prefills=[],
            decodes=[],
            varlen=None,
            paged_decode=PagedDecode(
                token_index=step.order,
                block_table=torch.from_numpy(step.table),
                context_lens=torch.from_numpy(step.context_lens),
                whole_step=True,
            ),
        ),
        logits_indices=step.order,
        sampled=step.states,
        sampled_rows=step.rows,
        argmax_only=rows.argmax_only(step.rows),
    )
