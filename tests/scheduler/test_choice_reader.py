"""A request with several choices at the front-end: forked into one request per choice (ids,
seeds, who scores the prompt, who reports logprobs for ranking), and their streams read as one
(every message names its choice; best_of keeps the most likely, best first; an error in any
choice ends the whole stream)."""

from __future__ import annotations

import asyncio

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestError, RequestRejected
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.frontend.choices import ChoiceReader, fork_choices
from scheduler_service.frontend.output_stream import OutputStream, StreamItem


def test_choices_get_their_own_ids_seeds_and_fork_from_the_first() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(n=2, best_of=3, seed=2**64 - 2, prompt_logprobs=1))
    choices = fork_choices(request)
    assert [c.request_id for c in choices] == ["r", "r#1", "r#2"]
    assert [c.fork_of for c in choices] == ["", "r", "r"]
    assert [c.sampling.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]
    assert [c.sampling.prompt_logprobs for c in choices] == [1, None, None]
    # Ranked by likelihood, so each reports its sampled tokens' logprobs.
    assert {(c.sampling.n, c.sampling.best_of, c.sampling.logprobs) for c in choices} == {(1, None, 0)}


def test_n_and_best_of_are_checked() -> None:
    assert "n must be at least 1, got 0" in SamplingParams(n=0, best_of=1).problems(100, 5)
    assert "best_of must be at least n (3), got 2" in SamplingParams(n=3, best_of=2).problems(100, 5)
    scored_once = SamplingParams(n=2, max_tokens=0, prompt_logprobs=0).problems(100, 5)
    assert "n and best_of above 1 cannot be combined with max_tokens 0 (the prompt is scored once)" in scored_once


def _record(token: int, logprob: float) -> executor_pb2.TokenLogprob:
    return executor_pb2.TokenLogprob(token_id=token, logprob=logprob)


def _finish(stream: OutputStream, tokens: list[int], logprobs: list[float]) -> None:
    message, _ = stream.add_tokens(tokens, [_record(t, lp) for t, lp in zip(tokens, logprobs, strict=True)])
    stream.send(message)
    stream.request.token_ids.extend(tokens)
    stream.request.finish_reason = FinishReason.LENGTH
    stream.close()


async def _read(reader: ChoiceReader) -> list[StreamItem]:
    items = []
    while (item := await reader.next_item()) is not None:
        items.append(item)
        if isinstance(item, RequestError):
            break
    return items


def _streams(request: Request) -> list[OutputStream]:
    return [OutputStream(choice, None) for choice in fork_choices(request)]


def test_the_choices_streams_read_as_one_each_message_naming_its_choice() -> None:
    async def run() -> list[StreamItem]:
        streams = _streams(Request("r", [1, 2], SamplingParams(n=2)))
        reader = ChoiceReader("r", streams, 2, client_logprobs=False)
        _finish(streams[1], [7, 8], [-1.0, -1.0])
        _finish(streams[0], [5], [-0.5])
        return await _read(reader)

    items = asyncio.run(run())
    assert all(isinstance(m, pb.GenerateResponse) and m.request_id == "r" for m in items)
    by_choice = {m.index: list(m.token_ids) for m in items if isinstance(m, pb.GenerateResponse)}
    assert by_choice == {0: [5], 1: [7, 8]}
    assert sorted(m.index for m in items if isinstance(m, pb.GenerateResponse) and m.finish_reason) == [0, 1]


def test_best_of_keeps_the_most_likely_best_first_with_the_prompts_scores() -> None:
    async def run() -> list[StreamItem]:
        streams = _streams(Request("r", [1, 2], SamplingParams(n=2, best_of=3, prompt_logprobs=0)))
        reader = ChoiceReader("r", streams, 2, client_logprobs=False)
        # The first choice, which carries the prompt's scores, is the least likely.
        prompt_score = _record(2, -0.25)
        message, _ = streams[0].add_tokens([4], [prompt_score, _record(4, -9.0)])
        streams[0].send(message)
        streams[0].request.finish_reason = FinishReason.LENGTH
        streams[0].close()
        _finish(streams[1], [5, 6], [-1.0, -1.5])
        _finish(streams[2], [7, 8], [-0.5, -0.5])
        return await _read(reader)

    items = asyncio.run(run())
    assert [(m.index, list(m.token_ids)) for m in items] == [(0, [7, 8]), (1, [5, 6])]
    assert not any(m.logprobs for m in items), "logprobs were not asked for"
    assert [lp.logprob for lp in items[0].prompt_logprobs] == [-0.25] and not items[1].prompt_logprobs


def test_an_error_in_one_choice_ends_the_stream_with_it() -> None:
    async def run() -> list[StreamItem]:
        streams = _streams(Request("r", [1, 2], SamplingParams(n=2)))
        reader = ChoiceReader("r", streams, 2, client_logprobs=False)
        streams[1].fail(RequestError(ErrorKind.INTERNAL, "boom"))
        items = await _read(reader)
        reader.close()
        return items

    items = asyncio.run(run())
    assert isinstance(items[-1], RequestError) and items[-1].message == "boom"


def test_a_request_over_the_choice_cap_is_refused() -> None:
    from scheduler_service.frontend.intake_limits import IntakeLimits, check_generate

    message = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(n=2, best_of=20))
    try:
        check_generate(message, IntakeLimits(max_choices=16), 100)
    except RequestRejected as rejected:
        assert "20 choices" in str(rejected) and "--max-choices" in str(rejected)
    else:
        raise AssertionError("20 choices were taken")
