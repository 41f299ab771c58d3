"""The sampler module on fixed logits: distributions, seeds, penalties and logprobs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from executor_service.sampling.sampler import (
    NUCLEUS_CANDIDATES,
    SamplingRow,
    _sorted_top_k_top_p,
    _top_k_top_p,
    apply_penalties,
    sample,
    sample_batch,
)
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.sampling.sampling_batch import SamplingBatch, token_masks_of

torch.set_num_threads(1)

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.4, 0.0, -0.3, -0.8, -1.5, -2.0])
DRAWS = 40_000
# Chi-square critical value at p = 1e-4 for up to 9 degrees of freedom is ~33.7; with a fixed
# seed the test is deterministic, the margin only guards against an unlucky seed choice.
CHI_SQUARE_LIMIT = 34.0


def row(params: SamplerSettings, generator: torch.Generator | None = None) -> SamplingRow:
    return SamplingRow(params=params, generator=generator, prompt_token_ids=[], output_token_ids=[])


def expected(params: SamplerSettings) -> torch.Tensor:
    """The distribution the settings define, computed from their definitions."""
    probs = torch.softmax(LOGITS.double() / params.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.min_p:
        keep &= probs >= params.min_p * probs.max()
    if params.top_k:
        keep &= probs >= probs.sort(descending=True).values[params.top_k - 1]
    if params.top_p < 1:
        order = probs.masked_fill(~keep, 0).sort(descending=True)
        renormed = order.values / order.values.sum()
        mass_before = renormed.cumsum(0) - renormed
        nucleus = torch.zeros_like(keep)
        nucleus[order.indices[mass_before < params.top_p]] = True
        keep &= nucleus
    kept = probs.masked_fill(~keep, 0)
    return kept / kept.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplerSettings(temperature=1.0),
        SamplerSettings(temperature=0.7),
        SamplerSettings(temperature=1.5, top_k=3),
        SamplerSettings(temperature=1.0, top_p=0.6),
        SamplerSettings(temperature=1.0, min_p=0.3),
        SamplerSettings(temperature=1.3, top_k=6, top_p=0.9),
    ],
    ids=["t1", "t0.7", "topk3", "topp0.6", "minp0.3", "topk6-topp0.9"],
)
def test_draws_follow_the_distribution(params: SamplerSettings) -> None:
    generator = torch.Generator().manual_seed(1234)
    logits = LOGITS.expand(DRAWS, -1).clone()
    tokens = sample(logits, [row(params)] * DRAWS, generator).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).double()
    want = expected(params) * DRAWS
    support = want > 0
    assert counts[~support].sum() == 0, "drew a token the settings exclude"
    chi_square = (((counts - want) ** 2)[support] / want[support]).sum().item()
    assert chi_square < CHI_SQUARE_LIMIT, (counts.tolist(), want.tolist())


def test_greedy_takes_the_argmax_and_ignores_filters() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    rows = [row(SamplerSettings(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5))] * 5
    assert sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def _seeded_tokens(position: int, others: int, steps: int = 20) -> list[int]:
    """Draws of a seed-42 row placed at `position` among `others` rows with other settings."""
    mine = torch.Generator().manual_seed(42)
    shared = torch.Generator().manual_seed(position * 1000 + others)
    my_logits = torch.Generator().manual_seed(7)
    other_logits = torch.Generator().manual_seed(8)
    tokens = []
    for _ in range(steps):
        logits = torch.randn(others + 1, 64, generator=other_logits)
        logits[position] = torch.randn(64, generator=my_logits)
        rows = [
            row(SamplerSettings(temperature=0.8 + 0.1 * (i % 3), top_k=i % 5), None)
            for i in range(others + 1)
        ]
        rows[position] = row(SamplerSettings(temperature=1.0, seed=42), mine)
        tokens.append(sample(logits, rows, shared).token_ids[position])
    return tokens


def test_seeded_row_ignores_the_rest_of_the_batch() -> None:
    alone = _seeded_tokens(position=0, others=0)
    assert _seeded_tokens(position=9, others=16) == alone
    assert _seeded_tokens(position=16, others=16) == alone


def test_penalties_follow_vllm_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    params = SamplerSettings(
        temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    rows = [SamplingRow(params, None, prompt_token_ids=[0, 1], output_token_ids=[3, 3, 2])]
    penalties = SamplingBatch.from_rows(rows, logits.shape[-1], logits.device).penalties
    assert penalties is not None
    penalised = apply_penalties(logits, penalties)
    # Token 0 (prompt, positive): /2. Token 1 (prompt, negative): *2. Token 2 (output once):
    # /2 - 0.5 - 0.25. Token 3 (output twice): /2 - 0.5 - 0.5. Token 4 unseen: unchanged.
    want = torch.tensor([[1.0, -2.0, 0.25 - 0.75, 1.5 - 1.0, 1.0]])
    torch.testing.assert_close(penalised, want)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplerSettings(temperature=0.0, frequency_penalty=1.0)
    rows = [SamplingRow(params, None, prompt_token_ids=[], output_token_ids=[0])]
    assert sample(logits, rows).token_ids == [1]


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    rows = [
        row(SamplerSettings(temperature=0.0, want_logprobs=True, num_logprobs=5)),
        row(SamplerSettings(temperature=0.5, top_k=2, want_logprobs=True, num_logprobs=0)),
        row(SamplerSettings(temperature=0.0)),
    ]
    result = sample(logits, rows, torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits, dim=-1)
    first, second, third = result.logprobs
    assert third is None
    assert first is not None and second is not None
    assert first.top_token_ids == raw[0].topk(5).indices.tolist()
    assert first.top_logprobs == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-6)
    assert first.token_logprob == pytest.approx(raw[0].max().item(), abs=1e-6)
    assert second.top_token_ids == []
    assert second.token_logprob == pytest.approx(raw[1, result.token_ids[1]].item(), abs=1e-6)
    assert math.isfinite(second.token_logprob)


def _min_tokens_row(outputs: int, temperature: float = 0.0) -> SamplingRow:
    # Token 0 is LOGITS' argmax and a stop id; token 5 is a second stop id.
    params = SamplerSettings(temperature=temperature, min_tokens=3, min_tokens_stop_ids=(0, 5))
    return SamplingRow(params, None, prompt_token_ids=[9, 9], output_token_ids=[1] * outputs)


def test_min_tokens_masks_stop_ids_until_enough_outputs() -> None:
    rows = [_min_tokens_row(n) for n in range(5)] + [row(SamplerSettings())]
    logits = LOGITS.expand(len(rows), -1).clone()
    result = sample(logits, rows)
    # Outputs 0, 1, 2 may not stop, so they take the runner-up; from 3 outputs on, the argmax.
    assert result.token_ids == [1, 1, 1, 0, 0, 0]
    assert torch.equal(logits, LOGITS.expand(len(rows), -1)), "the caller's logits changed"


def test_min_tokens_masks_stop_ids_in_draws() -> None:
    rows = [_min_tokens_row(outputs=2, temperature=1.0)] * 2000
    tokens = sample(LOGITS.expand(len(rows), -1).clone(), rows, torch.Generator().manual_seed(5))
    assert not {0, 5} & set(tokens.token_ids)


def test_tiny_temperature_is_greedy() -> None:
    # Divided by 1e-38 these logits overflow float32 to inf, whose softmax is NaN.
    logits = torch.tensor([[5.0, 6.0, 10.0, -10.0]] * 4)
    rows = [row(SamplerSettings(temperature=t)) for t in (1e-38, 1e-30, 1e-6, 9.9e-6)]
    assert sample(logits, rows, torch.Generator().manual_seed(0)).token_ids == [2] * 4


def test_logit_bias_moves_the_greedy_choice_and_leaves_logprobs_raw() -> None:
    # Token 3 is 1.1 below LOGITS' argmax (token 0): +1.2 makes it the greedy choice; -100 on
    # token 0 bans it in the second row, whose argmax becomes the runner-up.
    rows = [
        row(SamplerSettings(temperature=0.0, logit_bias=((3, 1.2),), want_logprobs=True, num_logprobs=1)),
        row(SamplerSettings(temperature=0.0, logit_bias=((0, -100.0),))),
        row(SamplerSettings(temperature=0.0)),
    ]
    logits = LOGITS.expand(len(rows), -1).clone()
    result = sample(logits, rows)
    assert result.token_ids == [3, 1, 0]
    biased = result.logprobs[0]
    assert biased is not None
    assert biased.token_logprob == pytest.approx(torch.log_softmax(LOGITS, dim=-1)[3].item(), abs=1e-6)
    assert torch.equal(logits, LOGITS.expand(len(rows), -1)), "the caller's logits changed"


def test_allowed_token_ids_bound_greedy_rows_and_draws() -> None:
    allowed = (4, 7, 8)
    rows = [row(SamplerSettings(temperature=0.0, allowed_token_ids=allowed))]
    rows += [row(SamplerSettings(temperature=1.0, allowed_token_ids=allowed))] * 500
    tokens = sample(LOGITS.expand(len(rows), -1).clone(), rows, torch.Generator().manual_seed(2)).token_ids
    assert tokens[0] == 4
    assert set(tokens[1:]) == set(allowed)


def test_a_steps_token_masks_bound_only_their_rows_greedy_and_drawn() -> None:
    # Row 0 greedy and rows 1.. drawn may sample tokens 5 and 9 only (bit t % 8 of byte t // 8,
    # in whole 32-bit words); the last row has no mask and keeps LOGITS' argmax.
    allowed = (5, 9)
    bitmask = bytearray(4)
    for token in allowed:
        bitmask[token // 8] |= 1 << (token % 8)
    rows = [row(SamplerSettings(temperature=0.0))] + [row(SamplerSettings(temperature=1.0))] * 300
    rows += [row(SamplerSettings(temperature=0.0))]
    places = list(range(len(rows) - 1))
    masks = token_masks_of(places, [bytes(bitmask)] * len(places), len(LOGITS), torch.device("cpu"))
    batch = replace(SamplingBatch.from_rows(rows, len(LOGITS), torch.device("cpu")), token_masks=masks)
    logits = LOGITS.expand(len(rows), -1).clone()
    tokens = sample_batch(logits, batch, torch.Generator().manual_seed(4)).token_ids
    assert tokens[0] == 5 and tokens[-1] == 0
    assert set(tokens[1:-1]) == set(allowed)
    assert torch.equal(logits, LOGITS.expand(len(rows), -1)), "the caller's logits changed"


def test_a_nucleus_cut_from_the_top_candidates_is_the_sorted_cut_and_the_rows_own() -> None:
    """Peaky rows (cut from their NUCLEUS_CANDIDATES best) and flat ones (sorted whole), top-k
    and top-p mixed: every row keeps exactly the tokens a sort of its whole row keeps, alone or
    in the batch."""
    generator = torch.Generator().manual_seed(5)
    vocab = 4 * NUCLEUS_CANDIDATES
    scales = torch.tensor([8.0, 4.0, 1.0, 0.1])
    logits = torch.randn(96, vocab, generator=generator) * scales.repeat(24)[:, None]
    top_k = torch.tensor([0, 1, 7, NUCLEUS_CANDIDATES - 1, NUCLEUS_CANDIDATES, 900]).repeat(16)
    top_p = torch.tensor([1.0, 0.95, 0.9, 0.5]).repeat_interleave(24)
    cut = _top_k_top_p(logits, top_k, top_p)
    sorted_cut = _sorted_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(cut.isinf(), sorted_cut.isinf())
    assert torch.equal(cut[~cut.isinf()], logits[~cut.isinf()])
    for row in range(0, 96, 7):
        alone = _top_k_top_p(logits[row : row + 1], top_k[row : row + 1], top_p[row : row + 1])
        assert torch.equal(alone[0], cut[row])
