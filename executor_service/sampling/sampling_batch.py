"""One step's sampling inputs, one entry per row that produces a token: flags and parameters as
arrays, so the sampler's per-step work is array operations rather than a loop over requests.

The runner gathers a batch from its persistent rows (runner/request_rows.py); callers without
those rows (the memory profile, tests) build one from SamplingRows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor_service.sampling.penalty_counts import PenaltyCounts
from executor_service.sampling.sampler_settings import SamplerSettings


@dataclass(slots=True)
class SamplingRow:
    """A row described by its token lists, for callers that keep no penalty counts."""

    params: SamplerSettings
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(slots=True)
class Penalties:
    """The rows of a step with repetition, presence or frequency penalties."""

    # Their rows in the step (int64); per such row its parameters [p] and its row in `counts`,
    # which the sampler gathers with the rest of its arithmetic over the vocab.
    index: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    counts: PenaltyCounts
    counts_rows: torch.Tensor
    # Outputs some rows have that their counts do not hold yet (PenaltyCounts.gather's ahead):
    # a verify step's row samples after the drafts before it (ContinuingRequest.draft_token_ids),
    # which a decode at its position would count; the counts take them only once accepted.
    ahead: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class LogitShaping:
    """The rows of a step whose logits are restricted to some tokens or biased (allowed_token_ids,
    logit_bias) before anything else reads them. Tensors on the logits' device."""

    # Restricted rows (their places in the step), and per such row a [vocab] mask of the tokens
    # it may sample.
    allowed_rows: torch.Tensor
    allowed: torch.Tensor
    # One entry per (row, token) with a bias: the row's place, the token and the bias.
    bias_rows: torch.Tensor
    bias_tokens: torch.Tensor
    bias_values: torch.Tensor


def logit_shaping_of(
    places: Sequence[int], settings: Sequence[SamplerSettings], vocab_size: int, device: torch.device
) -> LogitShaping | None:
    """The shaping of the rows at these places in a step, each with its settings; None when none
    shapes its logits."""
    shaped = [(place, params) for place, params in zip(places, settings, strict=True) if params.shapes_logits]
    if not shaped:
        return None
    restricted = [(place, params.allowed_token_ids) for place, params in shaped if params.allowed_token_ids]
    allowed = torch.zeros(len(restricted), vocab_size, dtype=torch.bool)
    for i, (_, token_ids) in enumerate(restricted):
        allowed[i, list(token_ids)] = True
    biased = [(place, token, bias) for place, params in shaped for token, bias in params.logit_bias]
    return LogitShaping(
        allowed_rows=torch.tensor([place for place, _ in restricted], dtype=torch.long, device=device),
        allowed=allowed.to(device),
        bias_rows=torch.tensor([place for place, _, _ in biased], dtype=torch.long, device=device),
        bias_tokens=torch.tensor([token for _, token, _ in biased], dtype=torch.long, device=device),
        bias_values=torch.tensor([bias for _, _, bias in biased], dtype=torch.float32, device=device),
    )


@dataclass(slots=True)
class TokenMasks:
    """The rows of a step restricted by the plan for this step alone (a grammar's next tokens),
    each with a [vocab] mask of the tokens it may sample. Tensors on the logits' device."""

    rows: torch.Tensor
    allowed: torch.Tensor


def token_masks_of(
    places: Sequence[int], bitmasks: Sequence[bytes], vocab_size: int, device: torch.device
) -> TokenMasks | None:
    """The masks of the rows at these places, from their plan's bitmasks (bit t % 32 of
    little-endian 32-bit word t / 32 allows token t); None when there are none."""
    if not places:
        return None
    packed = np.frombuffer(b"".join(bitmasks), dtype=np.uint8).reshape(len(places), -1)
    # unpackbits writes 0s and 1s: read as bools without a copy.
    allowed = np.unpackbits(packed, axis=1, count=vocab_size, bitorder="little").view(bool)
    return TokenMasks(
        rows=torch.tensor(list(places), dtype=torch.long, device=device),
        allowed=torch.from_numpy(allowed).to(device),
    )


@dataclass(slots=True)
class SamplingBatch:
    greedy: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    want_logprobs: np.ndarray
    num_logprobs: np.ndarray
    # A seeded row's own generator, set for the position it samples; None draws from the
    # step's shared generator.
    generators: list[torch.Generator | None]
    # (row, stop ids) for rows whose min_tokens still forbid stopping.
    stop_masks: list[tuple[int, tuple[int, ...]]]
    penalties: Penalties | None
    shaping: LogitShaping | None = None
    token_masks: TokenMasks | None = None

    def __len__(self) -> int:
        return len(self.greedy)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingBatch:
        params = [row.params for row in rows]
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        penalised_params = [params[i] for i in penalised]
        counts = PenaltyCounts(vocab_size, device)
        counts_rows = [counts.add(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in penalised]
        return cls(
            greedy=np.array([p.greedy for p in params], dtype=bool),
            temperature=np.array([p.temperature for p in params], dtype=np.float32),
            top_k=np.array([p.top_k for p in params], dtype=np.int64),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
            want_logprobs=np.array([p.want_logprobs for p in params], dtype=bool),
            num_logprobs=np.array([p.num_logprobs for p in params], dtype=np.int64),
            generators=[row.generator for row in rows],
            stop_masks=[
                (i, rows[i].params.min_tokens_stop_ids)
                for i in np.flatnonzero(
                    masks_stop_ids(
                        np.array([bool(p.min_tokens_stop_ids) for p in params], dtype=bool),
                        np.array([len(row.output_token_ids) for row in rows], dtype=np.int64),
                        np.array([p.min_tokens for p in params], dtype=np.int64),
                    )
                ).tolist()
            ],
            penalties=penalties_of(
                np.array(penalised, dtype=np.int64),
                np.array([p.repetition_penalty for p in penalised_params], dtype=np.float32),
                np.array([p.presence_penalty for p in penalised_params], dtype=np.float32),
                np.array([p.frequency_penalty for p in penalised_params], dtype=np.float32),
                counts,
                np.array(counts_rows, dtype=np.int64),
            )
            if penalised
            else None,
            shaping=logit_shaping_of(range(len(params)), params, vocab_size, device),
        )


def masks_stop_ids(has_stop_ids: np.ndarray, num_outputs: np.ndarray, min_tokens: np.ndarray) -> np.ndarray:
    """Per row, whether its min_tokens still forbid its stop ids: it has some and fewer outputs."""
    return has_stop_ids & (num_outputs < min_tokens)


def penalties_of(
    index: np.ndarray,
    repetition: np.ndarray,
    presence: np.ndarray,
    frequency: np.ndarray,
    counts: PenaltyCounts,
    counts_rows: np.ndarray,
) -> Penalties:
    """index: the penalised rows' places in the step; the rest: their parameters and their rows
    in counts."""
    device = counts.device
    return Penalties(
        index=torch.from_numpy(index).to(device),
        repetition=torch.from_numpy(repetition).to(device),
        presence=torch.from_numpy(presence).to(device),
        frequency=torch.from_numpy(frequency).to(device),
        counts=counts,
        counts_rows=torch.from_numpy(counts_rows).to(device),
    )
