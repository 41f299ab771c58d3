"""Speculative decoding's draft model (--draft-model, ContinuingRequest.num_model_drafts): a small
model of the same vocabulary that proposes the tokens a step then verifies.

Its K/V live in a cache of its own laid out like the model's, in the same block ids: a request's
block table serves both, so the scheduler's blocks for a step's drafts hold the draft model's K/V
of them too, and nothing else is allocated. Each request's state says up to where the draft
model's K/V are its tokens' (RequestState.num_draft_computed); before proposing, the draft model
computes the tokens since (all of them the first time, or after the request came back), in one
chunk whose last row gives its first draft, then one decode per further draft. A proposal is the
draft model's most likely token after the tokens before it: the verification accepts a draft
when it equals the token the model itself samples there, which for a sampled request happens
with that token's probability, so sampling keeps the model's distribution (rejection sampling
with a draft distribution that puts all its mass on one token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor_service.attention.attention_metadata import (
    SequenceSpan,
    build_step_attention,
)
from executor_service.attention.kv_cache import PagedKVCache
from executor_service.model.model_loader import LoadedModel
from executor_service.runner.forward import accepts_logits_to_keep, compute_logits
from executor_service.runner.plan_inputs import StepInputs
from executor_service.runner.request_rows import RequestState


@dataclass(slots=True, frozen=True)
class DraftRequest:
    """A request to propose for: count drafts after its tokens."""

    state: RequestState
    count: int


class DraftModel:
    def __init__(self, loaded: LoadedModel, kv_cache: PagedKVCache, backend: str) -> None:
        self.loaded = loaded
        self.kv_cache = kv_cache
        self.backend = backend
        self._use_logits_to_keep = accepts_logits_to_keep(loaded)
        # Since start: forwards run and tokens computed in them (catch-up chunks and drafts).
        self.num_forwards = 0
        self.num_tokens = 0

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's drafts, count of them, in order. Leaves each request's
        num_draft_computed after the positions whose K/V the draft model wrote, the drafts'
        included; the runner brings it back to the tokens the verification keeps."""
        proposals: list[list[int]] = [[] for _ in requests]
        # The first forward: each request's tokens the draft model has not computed, its last
        # known token included (whose row proposes the first draft).
        chunks = []
        for request in requests:
            state = request.state
            start = min(state.num_draft_computed, state.num_tokens - 1)
            chunks.append((start, state.tokens(start, state.num_tokens)))
        for proposal, token in zip(proposals, self._forward(requests, chunks), strict=True):
            proposal.append(token)
        for request in requests:
            request.state.num_draft_computed = request.state.num_tokens
        # Then one decode per further draft, of the requests that want it.
        for _ in range(1, max(request.count for request in requests)):
            going = [i for i, request in enumerate(requests) if len(proposals[i]) < request.count]
            chunks = [(requests[i].state.num_draft_computed, [proposals[i][-1]]) for i in going]
            tokens = self._forward([requests[i] for i in going], chunks)
            for i, token in zip(going, tokens, strict=True):
                proposals[i].append(token)
                requests[i].state.num_draft_computed += 1
        return proposals

    def _forward(self, requests: Sequence[DraftRequest], chunks: Sequence[tuple[int, list[int]]]) -> list[int]:
        """The draft model's most likely token after each chunk (tokens at positions from its
        start on, after the K/V it holds before them)."""
        token_ids: list[int] = []
        positions: list[int] = []
        spans: list[SequenceSpan] = []
        last_rows: list[int] = []
        for request, (start, tokens) in zip(requests, chunks, strict=True):
            spans.append(SequenceSpan(len(token_ids), len(tokens), start, tuple(request.state.block_ids)))
            token_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            last_rows.append(len(token_ids) - 1)
        device = self.loaded.device
        inputs = StepInputs(
            input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            attention=build_step_attention(spans, self.kv_cache, self.backend, device),
            logits_indices=torch.tensor(last_rows, dtype=torch.long, device=device),
            sampled=[],
            sampled_rows=np.zeros(0, dtype=np.int64),
            argmax_only=[True] * len(last_rows),
        )
        logits = compute_logits(self.loaded, inputs, self._use_logits_to_keep)
        self.num_forwards += 1
        self.num_tokens += len(token_ids)
        return logits.argmax(dim=-1).tolist()
