"""Vectorised sampling over the rows of a step that produce a token.

Order follows vLLM: logprobs from the raw logits; then allowed-token masks and logit biases,
the step's grammar masks, min-tokens masking and penalties, then greedy rows take
the argmax and the others go through temperature, min-p, top-k and top-p before a draw. Draws use
the exponential race (argmax of p / Exp(1) noise), and a seeded row draws its noise from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor_service.sampling.sampling_batch import (
    LogitShaping,
    Penalties,
    SamplingBatch,
    SamplingRow,
)


@dataclass(slots=True)
class TopLogprobs:
    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # One entry per row; None where the row did not ask for logprobs.
    logprobs: list[TopLogprobs | None]


# A row whose top-k and nucleus lie among its this many most likely tokens is cut from them
# alone, without sorting its whole vocabulary (see _top_k_top_p).
NUCLEUS_CANDIDATES = 256

# Each row's first largest index, as torch.argmax(dim=-1) gives it.
Argmax = Callable[[torch.Tensor], torch.Tensor]


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    default_generator: torch.Generator | None = None,
    argmax: Argmax | None = None,
) -> SampleResult:
    """sample_batch for rows described by their token lists."""
    batch = SamplingBatch.from_rows(rows, logits.shape[-1], logits.device)
    return sample_batch(logits, batch, default_generator, argmax)


def sample_batch(
    logits: torch.Tensor,
    batch: SamplingBatch,
    default_generator: torch.Generator | None = None,
    argmax: Argmax | None = None,
) -> SampleResult:
    """argmax: what greedy rows take (argmax_kernel.RowArgmax on CPU), torch's by default."""
    if logits.shape[0] != len(batch):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(batch)} sampling rows")
    if not len(batch):
        return SampleResult(token_ids=[], logprobs=[])
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.want_logprobs.any() else None
    if batch.shaping is not None:
        logits = apply_logit_shaping(logits, batch.shaping)
    if batch.token_masks is not None:
        logits = _restrict(logits, batch.token_masks.rows, batch.token_masks.allowed)
    logits = mask_min_tokens_stop_ids(logits, batch.stop_masks)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    tokens = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    random_rows = np.flatnonzero(~batch.greedy)
    if len(random_rows):
        device = logits.device
        index = torch.from_numpy(random_rows).to(device)
        probs = sampling_probs(
            logits[index],
            torch.from_numpy(batch.temperature[random_rows]).to(device),
            torch.from_numpy(batch.top_k[random_rows]).to(device),
            torch.from_numpy(batch.top_p[random_rows]).to(device),
            torch.from_numpy(batch.min_p[random_rows]).to(device),
        )
        generators = [batch.generators[i] for i in random_rows.tolist()]
        tokens[index] = _exponential_race(probs, generators, default_generator)
    token_list = tokens.tolist()
    return SampleResult(token_ids=token_list, logprobs=_logprobs(raw_logprobs, batch, tokens))


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution a non-greedy row draws from: temperature, then min-p, top-k, top-p."""
    logits = logits / temperature[:, None]
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    vocab = logits.shape[-1]
    if bool(((top_k > 0) & (top_k < vocab)).any()) or bool((top_p < 1).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's logits with -inf outside its top-k and then its nucleus (top-p).

    Sorting every row's whole vocabulary cost more than the forward (32 rows of 49k: 45 % of a
    SmolLM2 executor's time at temperature 0.7). A row whose cut lies within its
    NUCLEUS_CANDIDATES most likely tokens (a top-k below that, not tied at its edge; or, without
    top-k, a nucleus those tokens' mass passes before the least of them) is cut from them alone;
    a row with neither is left whole; the others are sorted whole. Which way a row goes depends
    on its own logits only, so a row's result never depends on its batch."""
    vocab = logits.shape[-1]
    width = min(vocab, NUCLEUS_CANDIDATES)
    if width == vocab:
        return _sorted_top_k_top_p(logits, top_k, top_p)
    raw, ids = logits.topk(width, dim=-1)
    k = top_k.clamp(min=0, max=vocab)
    in_k = torch.arange(width, device=logits.device)[None, :] < torch.where(k > 0, k, width)[:, None]
    values = raw.masked_fill(~in_k, float("-inf"))
    # Each row's mass over what its top-k leaves: the whole row without one.
    base = torch.where(k > 0, torch.logsumexp(values, dim=-1), torch.logsumexp(logits, dim=-1))
    probs = (values - base[:, None]).exp()
    tail = (1 - probs.sum(dim=-1)).clamp(min=0)
    edge = raw.gather(1, (k - 1).clamp(min=0, max=width - 1)[:, None]).squeeze(1)
    past_edge = raw.gather(1, k.clamp(max=width - 1)[:, None]).squeeze(1)
    by_k = (k > 0) & (k < width) & (edge > past_edge)
    by_p = (k == 0) & (top_p < 1) & (tail + probs[:, -1] <= 1 - top_p)
    whole = (k == 0) & (top_p >= 1)
    out = logits.clone()
    rows = (by_k | by_p).nonzero().squeeze(1)
    if rows.numel():
        # Least likely first, as the sorted path: the mass below a token starts with the tail
        # outside the candidates, all of which the nucleus leaves out.
        ascending = probs[rows].flip(-1)
        below = tail[rows, None] + ascending.cumsum(dim=-1)
        outside = below <= (1 - top_p[rows])[:, None]
        outside[:, -1] = False
        cut = values[rows].flip(-1).masked_fill(outside, float("-inf"))
        out[rows] = torch.full_like(out[rows], float("-inf")).scatter_(1, ids[rows].flip(-1), cut)
    slow = (~(by_k | by_p | whole)).nonzero().squeeze(1)
    if slow.numel():
        out[slow] = _sorted_top_k_top_p(logits[slow], top_k[slow], top_p[slow])
    return out


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    # k = 0 keeps everything: the threshold is then the smallest logit.
    kth = (vocab - top_k.clamp(min=0, max=vocab)).where(top_k > 0, torch.zeros_like(top_k))
    threshold = ascending.gather(1, kth.clamp(max=vocab - 1)[:, None])
    ascending = ascending.masked_fill(ascending < threshold, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    # Drop the least likely tokens whose total mass stays within 1 - p; the top token always stays.
    outside = cumulative <= (1 - top_p)[:, None]
    outside[:, -1] = False
    ascending = ascending.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def apply_logit_shaping(logits: torch.Tensor, shaping: LogitShaping) -> torch.Tensor:
    """-inf on every token a restricted row may not sample, then each bias added to its row's
    token. Out of place; only the shaped rows change."""
    if shaping.allowed_rows.numel():
        logits = _restrict(logits, shaping.allowed_rows, shaping.allowed)
    if shaping.bias_rows.numel():
        logits = logits.index_put((shaping.bias_rows, shaping.bias_tokens), shaping.bias_values, accumulate=True)
    return logits


def _restrict(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """-inf, out of place, on every token these rows (distinct, ascending) may not sample."""
    if len(rows) == len(logits):
        # Then they are every row (a batch of constrained requests): one pass, no gather and
        # put back.
        return logits.masked_fill(~allowed, float("-inf"))
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def mask_min_tokens_stop_ids(
    logits: torch.Tensor, stop_masks: list[tuple[int, tuple[int, ...]]]
) -> torch.Tensor:
    """-inf on the stop ids of every row that has fewer output tokens than its min_tokens, so
    neither greedy nor a draw can end the request early."""
    if not stop_masks:
        return logits
    row_index = [row for row, stop_ids in stop_masks for _ in stop_ids]
    token_index = [token for _, stop_ids in stop_masks for token in stop_ids]
    device = logits.device
    index = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
    # Out of place: the caller's logits stay as the model produced them.
    return logits.index_put(index, torch.tensor(float("-inf"), device=device))


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """vLLM semantics: repetition over prompt and output tokens, presence and frequency over
    output tokens only. Out of place; only the penalised rows change."""
    rows = logits[penalties.index]
    output_counts, prompt_seen = penalties.counts.gather(penalties.counts_rows, penalties.ahead)
    seen = prompt_seen | (output_counts > 0)
    repetition = penalties.repetition[:, None]
    penalised = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows = torch.where(seen, penalised, rows)
    rows = (
        rows
        - penalties.frequency[:, None] * output_counts
        - penalties.presence[:, None] * (output_counts > 0).float()
    )
    return logits.index_put((penalties.index,), rows)


def _exponential_race(
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(
            len(unseeded), probs.shape[1], device=probs.device
        ).exponential_(generator=default_generator)
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _logprobs(
    raw_logprobs: torch.Tensor | None, batch: SamplingBatch, tokens: torch.Tensor
) -> list[TopLogprobs | None]:
    if raw_logprobs is None:
        return [None] * len(batch)
    records = top_logprobs(raw_logprobs, tokens, batch.num_logprobs.tolist())
    return [record if wanted else None for record, wanted in zip(records, batch.want_logprobs.tolist(), strict=True)]


def top_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, widths: Sequence[int]) -> list[TopLogprobs]:
    """Per row of log-probabilities: its token's, and those of its widths[row] most likely
    tokens (sampled tokens, or the prompt tokens a row scores)."""
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    width = max(widths, default=0)
    top_values, top_ids = logprobs.topk(width, dim=-1) if width else (None, None)
    return [
        TopLogprobs(
            token_logprob=chosen[i],
            top_token_ids=top_ids[i, :n].tolist() if n else [],
            top_logprobs=top_values[i, :n].tolist() if n else [],
        )
        for i, n in enumerate(widths)
    ]
