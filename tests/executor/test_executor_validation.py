"""Wrong plan entries, over gRPC: each is rejected with INVALID_ARGUMENT and a message naming the
request and the problem, its state is dropped, and the other requests of the plan run on as if the
entry had not been there."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.executor_driver import PlanStream
from tests.helpers.executor_process import executor_channel
from tests.helpers.model_factory import VOCAB_SIZE, build_model

NUM_BLOCKS = 64
BLOCK_SIZE = 16
INVALID_ARGUMENT = 3
GOOD_PROMPT = list(range(100, 120))
VICTIM_PROMPT = list(range(200, 216))
GOOD_STEPS = 4

_ids = itertools.count()
# One bit per token, in whole 32-bit words.
BITMASK_BYTES = 4 * -(-VOCAB_SIZE // 32)


@pytest.fixture(scope="module")
def channel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpc.Channel]:
    model_dir: Path = build_model("llama", tmp_path_factory.mktemp("llama"))
    with executor_channel(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as channel:
        yield channel


@pytest.fixture
def stream(channel: grpc.Channel) -> Iterator[PlanStream]:
    stream = PlanStream(channel)
    yield stream
    stream.close()


def good_new(request_id: str) -> pb.NewRequest:
    return pb.NewRequest(
        request_id=request_id,
        token_ids=GOOD_PROMPT,
        block_ids=[0, 1],
        num_scheduled_tokens=len(GOOD_PROMPT),
    )


@pytest.fixture(scope="module")
def clean_tokens(channel: grpc.Channel) -> list[int]:
    """The good request's tokens when nothing else is in the plans."""
    stream = PlanStream(channel)
    request_id = f"clean{next(_ids)}"
    first = stream.step(pb.StepPlan(step_id=1, new_requests=[good_new(request_id)]))
    tokens = list(first.outputs[0].token_ids)
    decode = pb.ContinuingRequest(request_id=request_id, num_scheduled_tokens=1)
    for step in range(2, GOOD_STEPS + 1):
        result = stream.step(pb.StepPlan(step_id=step, continuing_requests=[decode]))
        tokens.extend(result.outputs[0].token_ids)
    stream.step(pb.StepPlan(step_id=GOOD_STEPS + 1, dropped_request_ids=[request_id]))
    stream.close()
    return tokens


def _new(**fields: object) -> Callable[[str, str], pb.StepPlan]:
    """A bad NewRequest under a fresh id."""

    def make(bad_id: str, victim_id: str) -> pb.StepPlan:
        entry = {
            "request_id": bad_id,
            "token_ids": list(range(300, 310)),
            "block_ids": [10],
            "num_scheduled_tokens": 10,
            **fields,
        }
        return pb.StepPlan(new_requests=[pb.NewRequest(**entry)])

    return make


def _sampling(**fields: object) -> Callable[[str, str], pb.StepPlan]:
    return _new(sampling=pb.SamplerConfig(**fields))


def _continuing(**fields: object) -> Callable[[str, str], pb.StepPlan]:
    """A bad ContinuingRequest on the victim (a request the executor holds)."""

    def make(bad_id: str, victim_id: str) -> pb.StepPlan:
        entry = {"request_id": victim_id, "num_scheduled_tokens": 1, **fields}
        return pb.StepPlan(continuing_requests=[pb.ContinuingRequest(**entry)])

    return make


BAD_ENTRIES: dict[str, tuple[Callable[[str, str], pb.StepPlan], str]] = {
    "new-block-outside-pool": (_new(block_ids=[NUM_BLOCKS]), "outside the pool"),
    "new-too-many-tokens-for-blocks": (
        _new(token_ids=list(range(300, 340)), block_ids=[10, 11], num_scheduled_tokens=40),
        "do not fit",
    ),
    "new-token-outside-vocab": (_new(token_ids=[5, VOCAB_SIZE, 6]), "outside the vocab"),
    "new-empty-tokens": (_new(token_ids=[], num_scheduled_tokens=1), "empty"),
    "new-prompt-longer-than-tokens": (_new(num_prompt_tokens=11), "num_prompt_tokens 11 exceeds"),
    "new-zero-scheduled": (_new(num_scheduled_tokens=0), "num_scheduled_tokens"),
    "new-scheduled-past-known": (_new(num_scheduled_tokens=11), "only 10 tokens are known"),
    "new-repeated-block": (
        _new(token_ids=list(range(300, 320)), block_ids=[10, 10], num_scheduled_tokens=20),
        "repeats",
    ),
    "negative-temperature": (_sampling(temperature=-0.5), "temperature"),
    "nan-temperature": (_sampling(temperature=math.nan), "temperature"),
    "inf-temperature": (_sampling(temperature=math.inf), "temperature"),
    "nan-top-p": (_sampling(temperature=1.0, top_p=math.nan), "top_p"),
    "nan-min-p": (_sampling(min_p=math.nan), "min_p"),
    "inf-repetition-penalty": (_sampling(repetition_penalty=math.inf), "repetition_penalty"),
    "nan-presence-penalty": (_sampling(presence_penalty=math.nan), "presence_penalty"),
    "min-tokens-stop-id-outside-vocab": (
        _sampling(min_tokens=2, min_tokens_stop_ids=[3, VOCAB_SIZE]),
        "min_tokens_stop_ids",
    ),
    "top-p-above-one": (_sampling(temperature=1.0, top_p=1.5), "top_p"),
    "top-p-negative": (_sampling(temperature=1.0, top_p=-0.1), "top_p"),
    "min-p-above-one": (_sampling(min_p=2.0), "min_p"),
    "negative-repetition-penalty": (_sampling(repetition_penalty=-1.0), "repetition_penalty"),
    "presence-penalty-out-of-range": (_sampling(presence_penalty=3.0), "presence_penalty"),
    "frequency-penalty-out-of-range": (_sampling(frequency_penalty=-2.5), "frequency_penalty"),
    "too-many-logprobs": (_sampling(want_logprobs=True, num_logprobs=21), "num_logprobs"),
    "logit-bias-id-outside-vocab": (
        _sampling(logit_bias_token_ids=[VOCAB_SIZE], logit_bias_values=[1.0]), "logit_bias names token"
    ),
    "logit-bias-out-of-range": (_sampling(logit_bias_token_ids=[4], logit_bias_values=[101.0]), "logit_bias values"),
    "logit-bias-nan": (_sampling(logit_bias_token_ids=[4], logit_bias_values=[math.nan]), "logit_bias values"),
    "logit-bias-id-twice": (
        _sampling(logit_bias_token_ids=[4, 4], logit_bias_values=[1.0, 2.0]), "names a token twice"
    ),
    "logit-bias-lengths-differ": (
        _sampling(logit_bias_token_ids=[4, 5], logit_bias_values=[1.0]), "differ in length"
    ),
    "allowed-token-outside-vocab": (_sampling(allowed_token_ids=[3, VOCAB_SIZE]), "allowed_token_ids"),
    "bitmask-too-short": (_new(allowed_token_bitmask=b"\xff" * 4), "allowed_token_bitmask has 4 bytes"),
    "bitmask-allows-nothing": (_new(allowed_token_bitmask=bytes(BITMASK_BYTES)), "allows no token"),
    "continuing-unknown-id": (
        lambda bad_id, victim_id: pb.StepPlan(
            continuing_requests=[pb.ContinuingRequest(request_id=bad_id, num_scheduled_tokens=1)]
        ),
        "unknown request id",
    ),
    "continuing-block-outside-pool": (
        _continuing(new_block_ids=[NUM_BLOCKS + 5]),
        "outside the pool",
    ),
    # The victim's 16 prompt tokens fill its one block; its 17th token needs a new block.
    "continuing-too-many-tokens-for-blocks": (_continuing(), "do not fit"),
    "continuing-bitmask-too-long": (
        _continuing(new_block_ids=[21], allowed_token_bitmask=b"\xff" * (BITMASK_BYTES + 4)),
        f"allowed_token_bitmask has {BITMASK_BYTES + 4} bytes",
    ),
    "continuing-scheduled-past-known": (
        _continuing(num_scheduled_tokens=2, new_block_ids=[21]),
        "only 17 tokens",
    ),
}


@pytest.mark.parametrize("case", BAD_ENTRIES)
def test_bad_entry_is_rejected_alone(
    stream: PlanStream, clean_tokens: list[int], case: str
) -> None:
    make_bad, expected_problem = BAD_ENTRIES[case]
    n = next(_ids)
    good, victim, bad = f"good{n}", f"victim{n}", f"bad{n}"
    first = stream.step(
        pb.StepPlan(
            step_id=1,
            new_requests=[
                good_new(good),
                pb.NewRequest(
                    request_id=victim,
                    token_ids=VICTIM_PROMPT,
                    block_ids=[20],
                    num_scheduled_tokens=16,
                ),
            ],
        )
    )
    assert not first.rejected
    tokens = list(first.outputs[0].token_ids)

    plan = make_bad(bad, victim)
    plan.step_id = 2
    good_decode = pb.ContinuingRequest(request_id=good, num_scheduled_tokens=1)
    plan.continuing_requests.insert(0, good_decode)
    result = stream.step(plan)
    named = (plan.new_requests or plan.continuing_requests[1:])[0].request_id
    assert [(r.request_id, r.code) for r in result.rejected] == [(named, INVALID_ARGUMENT)]
    assert named in result.rejected[0].message
    assert expected_problem in result.rejected[0].message
    assert [o.request_id for o in result.outputs] == [good]
    tokens.extend(result.outputs[0].token_ids)

    # The rejected entry's state is gone; the good request carries on untouched.
    for step in range(3, GOOD_STEPS + 1):
        result = stream.step(
            pb.StepPlan(
                step_id=step,
                continuing_requests=[
                    good_decode,
                    pb.ContinuingRequest(
                        request_id=named, num_scheduled_tokens=1, new_block_ids=[22 + step]
                    ),
                ],
            )
        )
        assert [r.request_id for r in result.rejected] == [named]
        assert "unknown request id" in result.rejected[0].message
        tokens.extend(result.outputs[0].token_ids)
    assert tokens == clean_tokens
    stream.step(pb.StepPlan(step_id=GOOD_STEPS + 1, dropped_request_ids=[good, victim, bad]))


def test_dropping_unknown_ids_is_a_no_op(stream: PlanStream, clean_tokens: list[int]) -> None:
    good = f"good{next(_ids)}"
    tokens = list(
        stream.step(
            pb.StepPlan(
                step_id=1, new_requests=[good_new(good)], dropped_request_ids=["never-seen"]
            )
        ).outputs[0].token_ids
    )
    for step in range(2, GOOD_STEPS + 1):
        result = stream.step(
            pb.StepPlan(
                step_id=step,
                dropped_request_ids=["never-seen", f"gone{step}"],
                continuing_requests=[pb.ContinuingRequest(request_id=good, num_scheduled_tokens=1)],
            )
        )
        assert not result.rejected
        tokens.extend(result.outputs[0].token_ids)
    assert tokens == clean_tokens
    stream.step(pb.StepPlan(step_id=GOOD_STEPS + 1, dropped_request_ids=[good, good]))


def only(token: int) -> bytes:
    """A bitmask allowing this token alone."""
    mask = bytearray(BITMASK_BYTES)
    mask[token // 8] |= 1 << (token % 8)
    return bytes(mask)


def test_a_bitmask_decides_the_sampled_token_and_leaves_the_neighbour_alone(
    stream: PlanStream, clean_tokens: list[int]
) -> None:
    n = next(_ids)
    good, masked = f"good{n}", f"masked{n}"
    forced = [VOCAB_SIZE - 1, 7, 300, 7]
    # Whatever the model prefers, the one allowed token is sampled, greedy or drawn.
    constrained = pb.NewRequest(
        request_id=masked,
        token_ids=VICTIM_PROMPT,
        block_ids=[20, 21],
        num_scheduled_tokens=len(VICTIM_PROMPT),
        sampling=pb.SamplerConfig(temperature=1.0),
        allowed_token_bitmask=only(forced[0]),
    )
    result = stream.step(pb.StepPlan(step_id=1, new_requests=[good_new(good), constrained]))
    outputs = {o.request_id: list(o.token_ids) for o in result.outputs}
    assert outputs[masked] == forced[:1]
    tokens = outputs[good]
    for step, token in enumerate(forced[1:], start=2):
        plan = pb.StepPlan(
            step_id=step,
            continuing_requests=[
                pb.ContinuingRequest(request_id=good, num_scheduled_tokens=1),
                pb.ContinuingRequest(request_id=masked, num_scheduled_tokens=1, allowed_token_bitmask=only(token)),
            ],
        )
        result = stream.step(plan)
        outputs = {o.request_id: list(o.token_ids) for o in result.outputs}
        assert outputs[masked] == [token]
        tokens += outputs[good]
    assert tokens == clean_tokens
    stream.step(pb.StepPlan(step_id=GOOD_STEPS + 1, dropped_request_ids=[good, masked]))


def test_a_bitmask_that_follows_its_plan_decides_the_token_and_a_stream_ending_first_frees_the_step(
    channel: grpc.Channel,
) -> None:
    n = next(_ids)
    masked = f"late{n}"
    stream = PlanStream(channel)
    first = pb.NewRequest(request_id=masked, token_ids=VICTIM_PROMPT, block_ids=[20, 21], num_scheduled_tokens=16)
    stream.send(pb.StepPlan(step_id=1, new_requests=[first]))
    follows = pb.ContinuingRequest(request_id=masked, num_scheduled_tokens=1, bitmask_follows=True)
    # Plan 2 goes out before result 1 is read, its bitmask after: as a pipelining scheduler sends.
    stream.send(pb.StepPlan(step_id=2, continuing_requests=[follows]))
    assert stream.receive().outputs
    late = pb.LateBitmask(request_id=masked, allowed_token_bitmask=only(VOCAB_SIZE - 2))
    stream.send(pb.StepPlan(bitmasks_for_step=2, late_bitmasks=[late]))
    assert list(stream.receive().outputs[0].token_ids) == [VOCAB_SIZE - 2]
    # A step whose bitmasks never come: the stream's end fails it rather than leaving the
    # executor's one worker waiting, and the next stream is served.
    stream.send(pb.StepPlan(step_id=3, continuing_requests=[follows]))
    stream.close()
    again = PlanStream(channel)
    new = pb.NewRequest(request_id=f"after{n}", token_ids=GOOD_PROMPT, block_ids=[0, 1], num_scheduled_tokens=20)
    assert again.step(pb.StepPlan(step_id=1, new_requests=[new])).outputs
    again.close()


def test_a_request_forked_from_a_copied_partial_block_continues_as_the_original(
    stream: PlanStream, clean_tokens: list[int]
) -> None:
    """A sibling choice takes the original's K/V of all but the prompt's last token: the full
    block shared, the partial one copied; it computes that last token itself, and its greedy
    tokens are the original's, while the original writes on into its own partial block."""
    n = next(_ids)
    original, fork = f"original{n}", f"fork{n}"
    tokens = {original: list(stream.step(pb.StepPlan(step_id=1, new_requests=[good_new(original)])).outputs[0].token_ids)}
    forked = pb.NewRequest(
        request_id=fork, token_ids=GOOD_PROMPT, block_ids=[0, 5], num_computed_tokens=len(GOOD_PROMPT) - 1, num_scheduled_tokens=1
    )
    plan = pb.StepPlan(
        step_id=2,
        new_requests=[forked],
        continuing_requests=[pb.ContinuingRequest(request_id=original, num_scheduled_tokens=1)],
        copy_block_sources=[1],
        copy_block_destinations=[5],
    )
    result = stream.step(plan)
    assert not result.rejected
    outputs = {o.request_id: list(o.token_ids) for o in result.outputs}
    tokens[original] += outputs[original]
    tokens[fork] = outputs[fork]
    assert tokens[fork] == clean_tokens[:1]
    for step in range(3, GOOD_STEPS + 2):
        decodes = [pb.ContinuingRequest(request_id=r, num_scheduled_tokens=1) for r in (original, fork)]
        result = stream.step(pb.StepPlan(step_id=step, continuing_requests=decodes))
        for output in result.outputs:
            tokens[output.request_id] += output.token_ids
    assert tokens[original][:GOOD_STEPS] == clean_tokens
    assert tokens[fork] == clean_tokens
    stream.step(pb.StepPlan(step_id=GOOD_STEPS + 2, dropped_request_ids=[original, fork]))


BAD_COPIES = {
    "lengths-differ": ([30, 31], [32], "differ in length"),
    "outside-pool": ([NUM_BLOCKS], [32], "outside the pool"),
    "into-a-source": ([30, 32], [32, 33], "both copied and copied into"),
    "into-one-block-twice": ([30, 31], [32, 32], "repeats a block"),
}


@pytest.mark.parametrize("case", BAD_COPIES)
def test_bad_block_copies_refuse_only_the_new_request_reading_them(stream: PlanStream, clean_tokens: list[int], case: str) -> None:
    """A scheduler's bug (INTERNAL): the request whose table holds a copy's destination is
    refused, the plan's other new request runs as it would have."""
    sources, destinations, problem = BAD_COPIES[case]
    n = next(_ids)
    good, reader = f"good{n}", f"reader{n}"
    reading = pb.NewRequest(request_id=reader, token_ids=GOOD_PROMPT, block_ids=[destinations[0], 41], num_computed_tokens=19, num_scheduled_tokens=1)
    plan = pb.StepPlan(step_id=1, new_requests=[good_new(good), reading], copy_block_sources=sources, copy_block_destinations=destinations)
    result = stream.step(plan)
    assert [(r.request_id, r.code) for r in result.rejected] == [(reader, 13)]
    assert problem in result.rejected[0].message
    assert [list(o.token_ids) for o in result.outputs if o.request_id == good] == [clean_tokens[:1]]
    stream.step(pb.StepPlan(step_id=2, dropped_request_ids=[good, reader]))
