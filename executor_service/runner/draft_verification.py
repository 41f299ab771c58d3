"""Speculative decoding's verification (ContinuingRequest.draft_token_ids): which drafts a step's
samples accept, and where each of a step's sampled rows stands among its request's drafts."""

from __future__ import annotations

from collections.abc import Sequence

from executor_service.runner.plan_inputs import ScheduledWork


def accepted_drafts(draft_token_ids: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the token sampled at the position before each: sampled[i]
    is the token a decode at the position of the request's last token plus i would have
    sampled, so a draft that equals it is that decode's token, and the first that does not ends
    the run (the tokens after it were computed from a token the request does not have)."""
    accepted = 0
    for draft, token in zip(draft_token_ids, sampled):
        if draft != token:
            break
        accepted += 1
    return accepted


def drafts_before_rows(sampling: Sequence[ScheduledWork]) -> list[tuple[int, ...]] | None:
    """Per sampled row of these sampling items (in work order, ScheduledWork.num_samples rows
    each), its request's drafts that come before the token it samples; None when no item has
    drafts, so every row samples its request's next token."""
    if not any(item.draft_token_ids for item in sampling):
        return None
    return [item.draft_token_ids[:ahead] for item in sampling for ahead in range(item.num_samples)]
