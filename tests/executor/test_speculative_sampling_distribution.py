"""Unseeded sampling with drafts draws from the model's distribution, as the sampler's own draws
do (test_executor_sampler.py's chi-square method and p = 1e-4 threshold): on a ModelRunner in
this process, a request whose context is fixed is sent its most likely next token as a draft,
over and over, and the first token each verify step answers follows the model's distribution
after the context, while the token after an accepted draft follows the model's distribution
after the context and that draft. A verifier that accepted a draft the sample did not equal, or
kept only some of the samples after it, would skew one of the two.

The model is the tests' random Llama with a 16-token vocabulary, so every token is drawn often
enough to be counted, and the most likely one is accepted a good share of the time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from executor_service.runner.model_runner import ModelRunner
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.draft_blocks import grow_blocks
from tests.helpers.model_factory import build_model

VOCAB = 16
BLOCK_SIZE = 4
# Context then the token sampled last: 7 positions with the draft, two blocks a request.
CONTEXT = [5, 9, 3, 12, 7]
LAST = 11
BLOCKS_PER_REQUEST = 2
REQUESTS_PER_STEP = 250
DRAWS = 20_000
# Chi-square critical value at p = 1e-4 for up to 15 degrees of freedom is ~44.3; the runner's
# generator is seeded, so the test is deterministic, the margin only guards against an unlucky
# seed choice.
CHI_SQUARE_LIMIT = 44.5
# Expected counts under this go into one bin, so each bin's count is near normal.
MIN_EXPECTED = 5.0


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRunner]:
    torch.set_num_threads(1)
    model_dir: Path = build_model("llama", tmp_path_factory.mktemp("llama16"), vocab_size=VOCAB)
    settings = ExecutorSettings(
        model_dir=model_dir,
        device="cpu",
        num_kv_blocks=REQUESTS_PER_STEP * BLOCKS_PER_REQUEST,
        block_size=BLOCK_SIZE,
        max_logprobs=VOCAB,
    )
    ready = build_executor(settings)
    yield ready.runner
    ready.runner.drop_all_requests(wipe_kv=True)


class Steps:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0

    def run(self, **fields: object) -> pb.StepResult:
        self.step_id += 1
        result = self.runner.execute(grow_blocks(self.runner, pb.StepPlan(step_id=self.step_id, **fields)))
        assert not result.HasField("failure"), result.failure.message
        assert not result.rejected, result.rejected[0].message
        return result


def _model_distribution(steps: Steps, tokens: list[int]) -> torch.Tensor:
    """The model's raw (temperature 1) distribution after tokens, from the logprobs over the
    whole vocabulary of a plain decode of the last of them (resumed after CONTEXT as the verify
    steps' requests are, computed up to it first)."""
    everything = pb.SamplerConfig(temperature=0, want_logprobs=True, num_logprobs=VOCAB)
    new = pb.NewRequest(
        request_id="reference",
        token_ids=tokens,
        num_prompt_tokens=len(CONTEXT),
        block_ids=range(BLOCKS_PER_REQUEST),
        num_scheduled_tokens=len(tokens) - 1,
        sampling=everything,
    )
    steps.run(new_requests=[new])
    decode = pb.ContinuingRequest(request_id="reference", num_scheduled_tokens=1)
    record = steps.run(continuing_requests=[decode]).outputs[0].logprobs[0]
    steps.runner.drop_all_requests()
    probs = torch.zeros(VOCAB, dtype=torch.float64)
    probs[list(record.top_token_ids)] = torch.tensor(list(record.top_logprobs), dtype=torch.float64).exp()
    assert abs(probs.sum().item() - 1) < 1e-4
    return probs


def _shaped(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution top-k then top-p leave (at temperature 1), from their definitions."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep &= probs >= probs.sort(descending=True).values[top_k - 1]
    if top_p < 1:
        order = probs.masked_fill(~keep, 0).sort(descending=True)
        renormed = order.values / order.values.sum()
        mass_before = renormed.cumsum(0) - renormed
        nucleus = torch.zeros_like(keep)
        nucleus[order.indices[mass_before < top_p]] = True
        keep &= nucleus
    kept = probs.masked_fill(~keep, 0)
    return kept / kept.sum()


def _verify_draws(steps: Steps, sampling: pb.SamplerConfig, draft: int) -> tuple[list[int], list[int]]:
    """DRAWS verify steps' answers for CONTEXT + [LAST] with the draft: every first token, and
    the token after the draft wherever it was accepted. Each request arrives as one resumed
    after a preemption (LAST counts as its sampled token), computed up to LAST, so the verify
    step samples at LAST's position and the draft's."""
    firsts: list[int] = []
    afters: list[int] = []
    while len(firsts) < DRAWS:
        ids = [f"r{i}" for i in range(min(REQUESTS_PER_STEP, DRAWS - len(firsts)))]
        steps.run(
            new_requests=[
                pb.NewRequest(
                    request_id=request_id,
                    token_ids=[*CONTEXT, LAST],
                    num_prompt_tokens=len(CONTEXT),
                    block_ids=range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST),
                    num_scheduled_tokens=len(CONTEXT),
                    sampling=sampling,
                )
                for i, request_id in enumerate(ids)
            ]
        )
        verified = steps.run(
            continuing_requests=[
                pb.ContinuingRequest(request_id=request_id, num_scheduled_tokens=2, draft_token_ids=[draft])
                for request_id in ids
            ]
        )
        for output in verified.outputs:
            tokens = list(output.token_ids)
            # The draft and the token after it, or the sample that rejected it.
            assert len(tokens) == (2 if tokens[0] == draft else 1), tokens
            firsts.append(tokens[0])
            afters += tokens[1:]
        steps.runner.drop_all_requests()
    return firsts, afters


def _assert_follows(tokens: list[int], want: torch.Tensor) -> None:
    """test_executor_sampler's chi-square test, with the tokens rarely expected binned together."""
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = want * len(tokens)
    support = want > 0
    assert counts[~support].sum() == 0, ("drew a token the settings exclude", counts.tolist(), want.tolist())
    rare = support & (expected < MIN_EXPECTED)
    binned_counts = torch.cat([counts[support & ~rare], counts[rare].sum().reshape(1)])
    binned_expected = torch.cat([expected[support & ~rare], expected[rare].sum().reshape(1)])
    if not rare.any():
        binned_counts, binned_expected = binned_counts[:-1], binned_expected[:-1]
    chi_square = (((binned_counts - binned_expected) ** 2) / binned_expected).sum().item()
    assert chi_square < CHI_SQUARE_LIMIT, (chi_square, counts.tolist(), expected.tolist())


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [(0, 1.0), (4, 1.0), (0, 0.7)],
    ids=["t1", "topk4", "topp0.7"],
)
def test_tokens_reached_through_accepted_drafts_follow_the_models_distribution(
    runner: ModelRunner, top_k: int, top_p: float
) -> None:
    # Unseeded draws come from the runner's generator; seeded here so the test is deterministic.
    runner._generator.manual_seed(2024)
    steps = Steps(runner)
    first_want = _shaped(_model_distribution(steps, [*CONTEXT, LAST]), top_k, top_p)
    draft = int(first_want.argmax())
    after_want = _shaped(_model_distribution(steps, [*CONTEXT, LAST, draft]), top_k, top_p)
    sampling = pb.SamplerConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    firsts, afters = _verify_draws(steps, sampling, draft)
    _assert_follows(firsts, first_want)
    # Enough accepted drafts that the test can tell distributions apart after them.
    assert len(afters) > DRAWS * first_want[draft].item() * 0.9 > 2000, (len(afters), first_want[draft].item())
    _assert_follows(afters, after_want)
