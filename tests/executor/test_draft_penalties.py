"""Penalties in a verify step (ContinuingRequest.draft_token_ids), on the persistent rows
(runner/request_rows.py) and the sampler's arithmetic, with no model: each row of a penalised
request with drafts is penalised exactly as a request whose outputs also hold the drafts before
that row (a decode at its position), drafts that repeat a token counting each time, rows of
other requests in the step untouched; and the kept counts take only what a verify commits, as
decodes of the same tokens one by one leave them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_service.runner.request_rows import PENALTY_ROW, RequestRows, RequestState
from executor_service.sampling.sampler import apply_penalties
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.sampling.sampling_batch import SamplingBatch, SamplingRow

VOCAB = 64
PROMPT = [5, 6, 7, 9, 11]
# Outputs so far; token 40 twice, so frequency counts more than presence.
OUTPUTS = [40, 41, 40]
PENALTIES = {
    "repetition": SamplerSettings(repetition_penalty=1.1),
    "presence": SamplerSettings(presence_penalty=0.5),
    "frequency": SamplerSettings(frequency_penalty=0.3),
    "all": SamplerSettings(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
}
# Drafts that repeat an earlier output (40), a prompt token (6) and an earlier draft (50).
DRAFTS = (40, 50, 6, 50)


def _admitted(rows: RequestRows, request_id: str, settings: SamplerSettings) -> RequestState:
    tokens = PROMPT + OUTPUTS
    return rows.admit(request_id, tokens, len(PROMPT), [0, 1, 2], len(tokens) - 1, settings)


def _as_decodes(settings: SamplerSettings, logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
    """Each row's logits penalised as a request with these outputs would be, counted afresh."""
    rows = [SamplingRow(settings, None, PROMPT, row_outputs) for row_outputs in outputs]
    penalties = SamplingBatch.from_rows(rows, VOCAB, logits.device).penalties
    assert penalties is not None
    return apply_penalties(logits, penalties)


@pytest.mark.parametrize("settings", PENALTIES.values(), ids=PENALTIES.keys())
def test_each_draft_row_is_penalised_as_a_decode_after_the_drafts_before_it(settings: SamplerSettings) -> None:
    rows = RequestRows(VOCAB, torch.device("cpu"))
    plain = _admitted(rows, "plain", SamplerSettings())
    spec = _admitted(rows, "spec", settings)
    other = _admitted(rows, "other", settings)
    # The step's rows: an unpenalised request, the drafted one (one row per position), and
    # another penalised request without drafts after it.
    step = np.array([plain.row] + [spec.row] * (1 + len(DRAFTS)) + [other.row], dtype=np.int64)
    ahead = [()] + [DRAFTS[:k] for k in range(1 + len(DRAFTS))] + [()]
    logits = torch.randn(len(step), VOCAB, generator=torch.Generator().manual_seed(7)) * 4
    penalties = rows.sampling(step, ahead).penalties
    assert penalties is not None
    penalised = apply_penalties(logits, penalties)

    assert torch.equal(penalised[0], logits[0])
    want = _as_decodes(settings, logits[1:], [OUTPUTS + list(drafts) for drafts in ahead[1:]])
    # Bit for bit: a verify step must sample what the decodes would.
    assert torch.equal(penalised[1:], want)
    # Counting the drafts matters here: the last draft row differs from one without them.
    assert not torch.equal(want[-2], _as_decodes(settings, logits[-2:-1], [OUTPUTS])[0])
    # The kept counts are as they were: the drafts are not accepted yet.
    assert torch.equal(_output_counts(rows, spec), _output_counts(rows, other))


@pytest.mark.parametrize("settings", PENALTIES.values(), ids=PENALTIES.keys())
def test_a_verify_commits_its_answer_to_the_counts_as_decodes_one_by_one(settings: SamplerSettings) -> None:
    verified, decoded = RequestRows(VOCAB, torch.device("cpu")), RequestRows(VOCAB, torch.device("cpu"))
    spec, plain = _admitted(verified, "spec", settings), _admitted(decoded, "plain", settings)
    # Drafts 40, 50, 6 sent; 40 and 50 accepted, then 7 sampled where 6 was proposed.
    answer = [40, 50, 7]
    # The step's sampling counts the drafts in its rows only.
    verified.sampling(np.array([spec.row] * 4, dtype=np.int64), [DRAFTS[:k] for k in range(4)])
    verified.extend_tokens(spec, answer)
    for token in answer:
        decoded.append_tokens(np.array([plain.row], dtype=np.int64), [token])
    assert torch.equal(_output_counts(verified, spec), _output_counts(decoded, plain))
    assert int(_output_counts(verified, spec)[40]) == 3 and int(_output_counts(verified, spec)[6]) == 0
    # The next step's row penalises alike.
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    assert torch.equal(_penalised_alone(verified, spec, logits), _penalised_alone(decoded, plain, logits))


def _output_counts(rows: RequestRows, state: RequestState) -> torch.Tensor:
    counts_row = torch.tensor([int(rows.ints[state.row, PENALTY_ROW])])
    return rows.penalty_counts.gather(counts_row)[0][0]


def _penalised_alone(rows: RequestRows, state: RequestState, logits: torch.Tensor) -> torch.Tensor:
    """The logits penalised as the request's next decode would penalise them."""
    penalties = rows.sampling(np.array([state.row], dtype=np.int64)).penalties
    assert penalties is not None
    return apply_penalties(logits, penalties)
