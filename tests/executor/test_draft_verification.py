"""Speculative decoding's verification (ContinuingRequest.draft_token_ids) on a ModelRunner in
this process, over a random Llama on the CPU's default float32 path (packed and panel GEMMs,
the C attention kernels), which is batch-invariant: a position's logits have the same bits in a
chunk of drafts as in a decode. So a request decoded with drafts, whichever drafts are right,
answers exactly the tokens and logprobs of decoding one token a step, its state ends as those
decodes leave it (penalty counts included), and entries the executor cannot verify are refused
saying why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from executor_service.runner.model_runner import ModelRunner
from executor_service.runner.request_rows import PENALTY_ROW, RequestRows, RequestState
from executor_service.runner.validation import Limits, check_continuing
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import ReadyExecutor, build_executor
from protos import rpc_codes
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.draft_blocks import grow_blocks
from tests.helpers.model_factory import VOCAB_SIZE, build_model

BLOCK_SIZE = 4
NUM_BLOCKS = 128
BLOCKS_PER_REQUEST = 12
PROMPT = [5, 6, 7, 300, 41]
OTHER_PROMPT = [9, 800, 12, 13, 14, 15, 16]
NEW_TOKENS = 24
GREEDY = pb.SamplerConfig(temperature=0, want_logprobs=True, num_logprobs=3)
SEEDED = pb.SamplerConfig(temperature=1.0, has_seed=True, seed=1234, want_logprobs=True, num_logprobs=2)
# Greedy and seeded among a few tokens, which then repeat, within a step's drafts too, so the
# penalties decide tokens (over the whole vocab this random model seldom repeats one soon).
FEW = range(10, 18)
GREEDY_FEW = pb.SamplerConfig(temperature=0, want_logprobs=True, num_logprobs=3, allowed_token_ids=FEW)
SEEDED_FEW = pb.SamplerConfig(
    temperature=1.0, has_seed=True, seed=1234, want_logprobs=True, num_logprobs=2, allowed_token_ids=FEW
)
PENALTIES: dict[str, dict[str, float]] = {
    "repetition": {"repetition_penalty": 1.1},
    "presence": {"presence_penalty": 0.5},
    "frequency": {"frequency_penalty": 0.3},
    "all": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3},
}

# What to propose after the request's tokens, given the plain decode's continuation from there:
# the drafts a step sends (each proposal's K is the number of drafts).
Proposer = Callable[[list[int]], list[int]]


@pytest.fixture(scope="module")
def ready(tmp_path_factory: pytest.TempPathFactory) -> ReadyExecutor:
    torch.set_num_threads(1)
    model_dir: Path = build_model("llama", tmp_path_factory.mktemp("llama"))
    settings = ExecutorSettings(model_dir=model_dir, device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    return build_executor(settings)


@pytest.fixture()
def runner(ready: ReadyExecutor) -> ModelRunner:
    ready.runner.drop_all_requests(wipe_kv=True)
    return ready.runner


@dataclass
class Decoded:
    """What a request answered, token by token, with each token's logprob record serialized
    (bitwise comparison) and how many tokens each step answered."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[bytes] = field(default_factory=list)
    per_step: list[int] = field(default_factory=list)

    def take(self, output: pb.RequestOutput) -> None:
        # One record per token when logprobs were asked for.
        assert len(output.logprobs) in (0, len(output.token_ids))
        self.tokens += output.token_ids
        self.logprobs += [record.SerializeToString() for record in output.logprobs]
        self.per_step.append(len(output.token_ids))


class Steps:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0

    def run(self, grow: bool = True, **fields: object) -> pb.StepResult:
        """grow: with the blocks the plan's entries need (draft_blocks.py)."""
        self.step_id += 1
        plan = pb.StepPlan(step_id=self.step_id, **fields)
        result = self.runner.execute(grow_blocks(self.runner, plan) if grow else plan)
        assert not result.HasField("failure"), result.failure.message
        return result


def _new(
    request_id: str, prompt: list[int], first_block: int, sampling: pb.SamplerConfig, **fields: object
) -> pb.NewRequest:
    return pb.NewRequest(
        request_id=request_id,
        token_ids=prompt,
        block_ids=range(first_block, first_block + BLOCKS_PER_REQUEST),
        num_scheduled_tokens=len(prompt),
        sampling=sampling,
        **fields,
    )


def _drafts(request_id: str, drafts: list[int]) -> pb.ContinuingRequest:
    return pb.ContinuingRequest(request_id=request_id, num_scheduled_tokens=1 + len(drafts), draft_token_ids=drafts)


def _plain(
    runner: ModelRunner, sampling: pb.SamplerConfig, prompt: list[int] = PROMPT, count: int = NEW_TOKENS
) -> Decoded:
    """The request decoded one token a step, alone."""
    runner.drop_all_requests(wipe_kv=True)
    steps, decoded = Steps(runner), Decoded()
    decoded.take(steps.run(new_requests=[_new("plain", prompt, 0, sampling)]).outputs[0])
    while len(decoded.tokens) < count:
        result = steps.run(continuing_requests=[pb.ContinuingRequest(request_id="plain", num_scheduled_tokens=1)])
        decoded.take(result.outputs[0])
    runner.drop_all_requests(wipe_kv=True)
    return decoded


def _wrong(token: int) -> int:
    return (token + 1) % VOCAB_SIZE


def _speculative(
    runner: ModelRunner, sampling: pb.SamplerConfig, reference: list[int], proposers: list[Proposer]
) -> Decoded:
    """The request decoded with one step per proposer, each proposing drafts from the plain
    decode's continuation after the tokens the request has (an empty proposal: a plain decode)."""
    steps, decoded = Steps(runner), Decoded()
    decoded.take(steps.run(new_requests=[_new("spec", PROMPT, 0, sampling)]).outputs[0])
    for propose in proposers:
        drafts = propose(reference[len(decoded.tokens) :])
        result = steps.run(continuing_requests=[_drafts("spec", drafts)])
        assert not result.rejected, result.rejected[0].message
        decoded.take(result.outputs[0])
        state = runner.requests["spec"]
        # Every token but the last answered one is computed, as after plain decodes.
        assert state.tokens(0, state.num_tokens) == PROMPT + decoded.tokens
        assert state.num_computed_tokens == len(PROMPT) + len(decoded.tokens) - 1
        # Its table keeps the blocks of its computed tokens; those of rejected drafts went back.
        assert len(state.block_ids) == -(-state.num_computed_tokens // BLOCK_SIZE)
        if state.sampling.has_penalties:
            # The penalty counts hold the answered tokens, not the rejected drafts.
            assert _output_counts(state) == _bincount(decoded.tokens)
    return decoded


def _output_counts(state: RequestState) -> list[int]:
    counts_row = torch.tensor([int(state.rows.ints[state.row, PENALTY_ROW])])
    return state.rows.penalty_counts.gather(counts_row)[0][0].int().tolist()


def _bincount(tokens: list[int]) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB_SIZE).tolist()


def _penalised(base: pb.SamplerConfig, penalties: dict[str, float]) -> pb.SamplerConfig:
    config = pb.SamplerConfig()
    config.CopyFrom(base)
    for name, value in penalties.items():
        setattr(config, name, value)
    return config


def _answered(drafts: list[int], future: list[int]) -> int:
    """The tokens a verify step answers: the drafts equal to the continuation, then one more."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == future[accepted]:
        accepted += 1
    return accepted + 1


def _right(count: int) -> Proposer:
    return lambda future: future[:count]


def _right_then_wrong(right: int, wrong: int) -> Proposer:
    return lambda future: future[:right] + [_wrong(t) for t in future[right : right + wrong]]


def _none(future: list[int]) -> list[int]:
    """No drafts: a plain decode of one token, sent as an entry."""
    return []


# Each proposer with the tokens it makes a step answer: accepted drafts + 1.
MIXED: list[tuple[Proposer, int]] = [
    (_right(3), 4),  # all right
    (_right_then_wrong(0, 3), 1),  # first wrong
    (_right_then_wrong(2, 2), 3),  # some right
    (_none, 1),  # a plain decode between verify steps
    (_right(1), 2),
    (_right_then_wrong(1, 1), 2),
    (_right(4), 5),
    (_right_then_wrong(0, 1), 1),
    (_right(2), 3),
]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_answer_exactly_what_plain_decoding_does(runner: ModelRunner, sampling: pb.SamplerConfig) -> None:
    reference = _plain(runner, sampling)
    decoded = _speculative(runner, sampling, reference.tokens, [propose for propose, _ in MIXED])
    # The first step is the prefill; each verify step answers its accepted drafts and one more.
    assert decoded.per_step == [1] + [answered for _, answered in MIXED]
    assert decoded.tokens == reference.tokens[: len(decoded.tokens)]
    assert decoded.logprobs == reference.logprobs[: len(decoded.tokens)]


def _repeating(future: list[int]) -> list[int]:
    """Drafts that repeat the run's own first tokens: right as far as the continuation does."""
    return [future[0], future[1], future[0], future[1]]


def _echoing_first(future: list[int]) -> list[int]:
    """The right next token, then it again twice: the rows after it count it once, then twice."""
    return [future[0]] * 3


PENALISED_RUN: list[Proposer] = [
    _right(3),  # all right
    _right_then_wrong(0, 3),  # first wrong
    _right_then_wrong(2, 2),  # some right
    _none,
    _repeating,
    _right(4),
    _echoing_first,
    _right_then_wrong(1, 1),
    _right(2),
]


@pytest.mark.parametrize("sampling", [GREEDY_FEW, SEEDED_FEW], ids=["greedy", "seeded"])
@pytest.mark.parametrize("penalties", PENALTIES.values(), ids=PENALTIES.keys())
def test_penalised_drafts_answer_exactly_what_plain_decoding_does(
    runner: ModelRunner, sampling: pb.SamplerConfig, penalties: dict[str, float]
) -> None:
    penalised = _penalised(sampling, penalties)
    reference = _plain(runner, penalised, count=40)
    expected, have, accepted_runs = [1], 1, []
    for propose in PENALISED_RUN:
        future = reference.tokens[have:]
        expected.append(_answered(propose(future), future))
        accepted_runs.append(future[: expected[-1] - 1])
        have += expected[-1]
    # Some step accepts drafts that repeat a token of their own run: its later rows count it
    # more than once before it is committed.
    assert any(len(set(run)) < len(run) for run in accepted_runs)
    decoded = _speculative(runner, penalised, reference.tokens, PENALISED_RUN)
    assert decoded.per_step == expected
    assert decoded.tokens == reference.tokens[: len(decoded.tokens)]
    assert decoded.logprobs == reference.logprobs[: len(decoded.tokens)]


PENALISED_GREEDY = _penalised(GREEDY_FEW, PENALTIES["all"])
PENALISED_SEEDED = _penalised(SEEDED_FEW, PENALTIES["all"])


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, SEEDED, PENALISED_GREEDY, PENALISED_SEEDED],
    ids=["greedy", "seeded", "greedy-penalised", "seeded-penalised"],
)
def test_steady_decodes_by_handle_and_verify_steps_take_turns(runner: ModelRunner, sampling: pb.SamplerConfig) -> None:
    # Steady decodes read the request's last token and progress from the rows' tables (in C),
    # so a verify step must leave those as decodes would.
    reference = _plain(runner, sampling)
    steps, decoded = Steps(runner), Decoded()
    decoded.take(steps.run(new_requests=[_new("spec", PROMPT, 0, sampling, handle=3)]).outputs[0])
    turns: list[Proposer | None] = [_right_then_wrong(1, 2), None, None, _right(3), None, _right_then_wrong(0, 2), None]
    for propose in turns:
        if propose is None:
            result = steps.run(decode_handles=[3])
            assert result.decode_token_ids[0] == reference.tokens[len(decoded.tokens)]
            decoded.tokens.append(result.decode_token_ids[0])
            decoded.per_step.append(1)
            continue
        drafts = propose(reference.tokens[len(decoded.tokens) :])
        decoded.take(steps.run(continuing_requests=[_drafts("spec", drafts)]).outputs[0])
    assert decoded.per_step == [1, 2, 1, 1, 4, 1, 1, 1]
    assert decoded.tokens == reference.tokens[: len(decoded.tokens)]


def test_shaped_top_k_top_p_sampling_verifies_as_its_plain_decodes(runner: ModelRunner) -> None:
    allowed = list(range(0, VOCAB_SIZE, 3))
    sampling = pb.SamplerConfig(
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.01,
        has_seed=True,
        seed=7,
        want_logprobs=True,
        num_logprobs=4,
        allowed_token_ids=allowed,
        logit_bias_token_ids=[3, 6, 9],
        logit_bias_values=[2.0, -1.0, 3.5],
    )
    reference = _plain(runner, sampling)
    assert set(reference.tokens) <= set(allowed)
    decoded = _speculative(runner, sampling, reference.tokens, [propose for propose, _ in MIXED])
    assert decoded.per_step == [1] + [answered for _, answered in MIXED]
    assert decoded.tokens == reference.tokens[: len(decoded.tokens)]
    assert decoded.logprobs == reference.logprobs[: len(decoded.tokens)]


def test_a_stop_id_held_back_by_min_tokens_is_refused_as_a_draft_until_min_tokens_are_out(
    runner: ModelRunner,
) -> None:
    # A large bias makes token 77 the greedy choice wherever min_tokens lets it be sampled: from
    # the seventh output on.
    sampling = pb.SamplerConfig(
        temperature=0,
        min_tokens=6,
        min_tokens_stop_ids=[77],
        logit_bias_token_ids=[77],
        logit_bias_values=[100.0],
        want_logprobs=True,
    )
    plain = _plain(runner, sampling, count=9)
    reference = plain.tokens
    assert 77 not in reference[:6] and reference[6:8] == [77, 77]
    steps, decoded = Steps(runner), Decoded()
    decoded.take(steps.run(new_requests=[_new("spec", PROMPT, 0, sampling)]).outputs[0])
    # Outputs 1..3 proposed as the stop id: output 1 may not be it.
    decoded.take(steps.run(continuing_requests=[_drafts("spec", [77, 77, 77])]).outputs[0])
    # Output 2 right; output 3, with three outputs before it (one of them a draft), may not be 77.
    decoded.take(steps.run(continuing_requests=[_drafts("spec", [reference[2], 77, 77])]).outputs[0])
    # Outputs 4 and 5 right; output 6 has six before it (two of them drafts): it may be 77.
    decoded.take(steps.run(continuing_requests=[_drafts("spec", [reference[4], reference[5], 77, 77])]).outputs[0])
    assert decoded.per_step == [1, 1, 2, 5]
    assert decoded.tokens == reference
    assert decoded.logprobs == plain.logprobs


def _masked_alone(runner: ModelRunner, bitmask: bytes) -> list[int]:
    """PROMPT's greedy token, then its next under the bitmask, alone."""
    runner.drop_all_requests(wipe_kv=True)
    steps = Steps(runner)
    first = steps.run(new_requests=[_new("masked", PROMPT, 0, pb.SamplerConfig(temperature=0))]).outputs[0].token_ids[0]
    masked = pb.ContinuingRequest(request_id="masked", num_scheduled_tokens=1, allowed_token_bitmask=bitmask)
    second = steps.run(continuing_requests=[masked]).outputs[0].token_ids[0]
    runner.drop_all_requests(wipe_kv=True)
    return [first, second]


def test_verify_steps_batched_with_prefills_decodes_and_masks_answer_what_each_alone_does(
    runner: ModelRunner,
) -> None:
    greedy = pb.SamplerConfig(temperature=0)
    spec = _plain(runner, GREEDY)
    other = _plain(runner, greedy, prompt=OTHER_PROMPT, count=3).tokens
    late = _plain(runner, SEEDED, prompt=OTHER_PROMPT, count=2)
    # A grammar mask for a request after the drafted one in the plan: it must land on that
    # request's row, not on one of the drafted request's rows.
    allowed = [10, 500]
    words = bytearray(4 * (-(-VOCAB_SIZE // 32)))
    for token in allowed:
        words[token // 8] |= 1 << (token % 8)
    masked = _masked_alone(runner, bytes(words))
    assert masked[1] in allowed and _plain(runner, greedy, count=2).tokens[1] not in allowed
    steps = Steps(runner)
    first = steps.run(
        new_requests=[
            _new("spec", PROMPT, 0, GREEDY),
            _new("other", OTHER_PROMPT, BLOCKS_PER_REQUEST, greedy, handle=5),
            _new("masked", PROMPT, 2 * BLOCKS_PER_REQUEST, greedy),
        ]
    )
    assert [o.token_ids[0] for o in first.outputs] == [spec.tokens[0], other[0], masked[0]]
    # Sampled rows in plan order: late's 1, spec's 4, masked's 1, then the decode by handle.
    second = steps.run(
        new_requests=[_new("late", OTHER_PROMPT, 3 * BLOCKS_PER_REQUEST, SEEDED)],
        continuing_requests=[
            _drafts("spec", [spec.tokens[1], spec.tokens[2], _wrong(spec.tokens[3])]),
            pb.ContinuingRequest(request_id="masked", num_scheduled_tokens=1, allowed_token_bitmask=bytes(words)),
        ],
        decode_handles=[5],
    )
    assert not second.rejected
    outputs = {o.request_id: o for o in second.outputs}
    assert list(outputs["spec"].token_ids) == spec.tokens[1:4]
    assert [r.SerializeToString() for r in outputs["spec"].logprobs] == spec.logprobs[1:4]
    assert list(outputs["late"].token_ids) == late.tokens[:1]
    assert [r.SerializeToString() for r in outputs["late"].logprobs] == late.logprobs[:1]
    assert list(outputs["masked"].token_ids) == masked[1:]
    assert list(second.decode_token_ids) == other[1:2]
    # Another verify step beside a plain decode of each kind.
    third = steps.run(
        continuing_requests=[
            pb.ContinuingRequest(request_id="late", num_scheduled_tokens=1),
            _drafts("spec", spec.tokens[4:6]),
        ],
        decode_handles=[5],
    )
    outputs = {o.request_id: o for o in third.outputs}
    assert list(outputs["spec"].token_ids) == spec.tokens[4:7]
    assert [r.SerializeToString() for r in outputs["spec"].logprobs] == spec.logprobs[4:7]
    assert list(outputs["late"].token_ids) == late.tokens[1:2]
    assert list(third.decode_token_ids) == other[2:3]


def test_penalised_and_plain_requests_verified_in_one_step_answer_what_each_alone_does(
    runner: ModelRunner,
) -> None:
    # Penalised rows among unpenalised ones: each draft row's counts must land on its own row.
    samplings = {"a": PENALISED_GREEDY, "b": GREEDY, "c": PENALISED_SEEDED}
    prompts = {"a": PROMPT, "b": OTHER_PROMPT, "c": OTHER_PROMPT}
    alone = {rid: _plain(runner, samplings[rid], prompt=prompts[rid], count=14) for rid in samplings}
    steps = Steps(runner)
    decoded = {rid: Decoded() for rid in samplings}
    first = steps.run(
        new_requests=[
            _new(rid, prompts[rid], i * BLOCKS_PER_REQUEST, samplings[rid]) for i, rid in enumerate(samplings)
        ]
    )
    for output in first.outputs:
        decoded[output.request_id].take(output)
    rounds: list[dict[str, Proposer]] = [
        {"b": _right_then_wrong(2, 1), "a": _repeating, "c": _none},
        {"c": _right(3), "a": _echoing_first, "b": _none},
        {"a": _right_then_wrong(1, 2), "c": _repeating, "b": _right(2)},
    ]
    for proposers in rounds:
        entries, expected = [], {}
        for rid, propose in proposers.items():
            future = alone[rid].tokens[len(decoded[rid].tokens) :]
            drafts = propose(future)
            expected[rid] = _answered(drafts, future)
            entries.append(_drafts(rid, drafts))
        result = steps.run(continuing_requests=entries)
        assert not result.rejected
        for output in result.outputs:
            decoded[output.request_id].take(output)
            assert decoded[output.request_id].per_step[-1] == expected[output.request_id]
    for rid, reference in alone.items():
        tokens = decoded[rid].tokens
        assert tokens == reference.tokens[: len(tokens)]
        assert decoded[rid].logprobs == reference.logprobs[: len(tokens)]
        state = runner.requests[rid]
        if state.sampling.has_penalties:
            assert _output_counts(state) == _bincount(tokens)


def test_describe_says_drafts_are_verified(ready: ReadyExecutor) -> None:
    assert ready.info.supports_draft_tokens


def _refusal(
    runner: ModelRunner, entry: pb.ContinuingRequest, sampling: pb.SamplerConfig = GREEDY, scheduled: int | None = None
) -> str:
    """Sends the request, prefilled (all of its prompt, or `scheduled` tokens of it), then the
    entry; returns the refusal's message after checking its code."""
    runner.drop_all_requests(wipe_kv=True)
    steps = Steps(runner)
    new = _new(entry.request_id, PROMPT, 0, sampling)
    if scheduled is not None:
        new.num_scheduled_tokens = scheduled
    steps.run(new_requests=[new])
    result = steps.run(continuing_requests=[entry])
    assert [r.request_id for r in result.rejected] == [entry.request_id] and not result.outputs
    assert result.rejected[0].code == rpc_codes.INVALID_ARGUMENT
    return result.rejected[0].message


def test_entries_with_drafts_it_cannot_verify_are_refused_saying_why(runner: ModelRunner) -> None:
    wrong_count = pb.ContinuingRequest(request_id="r", num_scheduled_tokens=2, draft_token_ids=[1, 2])
    assert "num_scheduled_tokens 2 with 2 draft_token_ids" in _refusal(runner, wrong_count)
    outside = _drafts("r", [3, VOCAB_SIZE])
    assert f"draft_token_ids: token id {VOCAB_SIZE} outside the vocab" in _refusal(runner, outside)
    every = b"\xff" * (4 * (-(-VOCAB_SIZE // 32)))
    masked = _drafts("r", [3])
    masked.allowed_token_bitmask = every
    assert "need draft_bitmasks too" in _refusal(runner, masked)
    masked.draft_bitmasks.extend([every, every])
    assert "2 draft_bitmasks for 1 draft_token_ids: one per draft" in _refusal(runner, masked)
    unmasked = _drafts("r", [3])
    unmasked.draft_bitmasks.append(every)
    assert "need draft_bitmasks too, and draft_bitmasks need it" in _refusal(runner, unmasked)
    follows = _drafts("r", [3])
    follows.bitmask_follows = True
    assert "bitmask_follows" in _refusal(runner, follows)
    # Two prompt tokens still to compute: drafts would skip them.
    assert "every token but the last sampled one computed" in _refusal(runner, _drafts("r", [3]), scheduled=3)
    # All but the last prompt token computed: that token is the prompt's, not a sampled one.
    assert "prompt tokens are computed" in _refusal(runner, _drafts("r", [3]), scheduled=len(PROMPT) - 1)
    # A refused request is forgotten, as any refused entry is.
    assert "r" not in runner.requests


def test_drafts_past_the_blocks_are_refused(runner: ModelRunner) -> None:
    steps = Steps(runner)
    new = _new("r", PROMPT, 0, GREEDY)
    del new.block_ids[2:]  # 8 slots: the prompt's 5 tokens, then the sampled one at 5.
    steps.run(new_requests=[new])
    result = steps.run(grow=False, continuing_requests=[_drafts("r", [1, 2, 3])])
    assert "9 tokens do not fit in 2 blocks" in result.rejected[0].message


def test_drafts_past_max_model_len_or_on_a_model_with_recurrent_layers_are_refused() -> None:
    rows = RequestRows(VOCAB_SIZE, torch.device("cpu"))
    # The prompt computed, one token sampled after it.
    state = rows.admit("r", PROMPT + [9], len(PROMPT), [0, 1, 2], len(PROMPT), SamplerSettings())
    limits = Limits(vocab_size=VOCAB_SIZE, num_kv_blocks=8, block_size=4, max_model_len=8, max_logprobs=5)
    assert check_continuing(_drafts("r", [1, 2]), state, limits) is None
    # Positions 5..8: the last is past the model's 8.
    assert "past max_model_len 8" in (check_continuing(_drafts("r", [1, 2, 3]), state, limits) or "")
    recurrent = replace(limits, num_state_slots=2)
    assert "recurrent layers" in (check_continuing(_drafts("r", [1, 2]), state, recurrent) or "")
