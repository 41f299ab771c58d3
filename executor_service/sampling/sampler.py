"""Vectorised sampling over the rows of a step that produce a token.

Order follows vLLM: min-tokens masking and penalties on the raw logits, then greedy rows take
the argmax and the others go through temperature, min-p, top-k and top-p before a draw. Draws use
the exponential race (argmax of p / Exp(1) noise), and a seeded row draws its noise from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_service.sampling.sampler_settings import SamplerSettings


@dataclass(slots=True)
class SamplingRow:
    params: SamplerSettings
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


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


# Each row's first largest index, as torch.argmax(dim=-1) gives it.
Argmax = Callable[[torch.Tensor], torch.Tensor]


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    default_generator: torch.Generator | None = None,
    argmax: Argmax | None = None,
) -> SampleResult:
    """argmax: what greedy rows take (argmax_kernel.RowArgmax on CPU), torch's by default."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    if not rows:
        return SampleResult(token_ids=[], logprobs=[])
    logits = logits.float()
    raw_logprobs = (
        torch.log_softmax(logits, dim=-1) if any(r.params.want_logprobs for r in rows) else None
    )
    logits = mask_min_tokens_stop_ids(logits, rows)
    if any(r.params.has_penalties for r in rows):
        logits = apply_penalties(logits, rows)
    tokens = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = sampling_probs(logits[index], [rows[i].params for i in random_rows])
        generators = [rows[i].generator for i in random_rows]
        tokens[index] = _exponential_race(probs, generators, default_generator)
    token_list = tokens.tolist()
    return SampleResult(token_ids=token_list, logprobs=_logprobs(raw_logprobs, rows, tokens))


def sampling_probs(logits: torch.Tensor, params: list[SamplerSettings]) -> torch.Tensor:
    """The distribution a non-greedy row draws from: temperature, then min-p, top-k, top-p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    vocab = logits.shape[-1]
    if bool(((top_k > 0) & (top_k < vocab)).any()) or bool((top_p < 1).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
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


def mask_min_tokens_stop_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """-inf on the stop ids of every row that has fewer output tokens than its min_tokens, so
    neither greedy nor a draw can end the request early."""
    row_index: list[int] = []
    token_index: list[int] = []
    for i, r in enumerate(rows):
        if r.params.masks_stop_ids(len(r.output_token_ids)):
            row_index.extend([i] * len(r.params.min_tokens_stop_ids))
            token_index.extend(r.params.min_tokens_stop_ids)
    if not row_index:
        return logits
    device = logits.device
    index = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
    # Out of place: the caller's logits stay as the model produced them.
    return logits.index_put(index, torch.tensor(float("-inf"), device=device))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM semantics: repetition over prompt and output tokens, presence and frequency over
    output tokens only."""
    device = logits.device
    vocab = logits.shape[-1]
    output_counts = _token_counts([r.output_token_ids for r in rows], vocab, device)
    prompt_seen = _token_counts([r.prompt_token_ids for r in rows], vocab, device) > 0
    repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
    seen = prompt_seen | (output_counts > 0)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
    return logits - frequency * output_counts - presence * (output_counts > 0).float()


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    # Padding points at an extra column that is cut off afterwards.
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


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
    raw_logprobs: torch.Tensor | None, rows: list[SamplingRow], tokens: torch.Tensor
) -> list[TopLogprobs | None]:
    if raw_logprobs is None:
        return [None] * len(rows)
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    width = max(r.params.num_logprobs for r in rows)
    top_values, top_ids = raw_logprobs.topk(width, dim=-1) if width else (None, None)
    result: list[TopLogprobs | None] = []
    for i, row in enumerate(rows):
        if not row.params.want_logprobs:
            result.append(None)
            continue
        n = row.params.num_logprobs
        result.append(
            TopLogprobs(
                token_logprob=chosen[i],
                top_token_ids=top_ids[i, :n].tolist() if n else [],
                top_logprobs=top_values[i, :n].tolist() if n else [],
            )
        )
    return result
