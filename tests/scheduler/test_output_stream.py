"""A stream that fell behind catches up in one message: the tokens, text and logprobs of the
messages queued behind the next one are folded into it, in order, and nothing else is. With a
stream interval, tokens leave in groups, the first token and the end at once."""

import asyncio

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestError
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.service.output_stream import OutputStream


def _message(tokens: list[int], text: str) -> pb.GenerateResponse:
    message = pb.GenerateResponse(request_id="r", token_ids=tokens, text=text)
    for token in tokens:
        message.logprobs.add(token_id=token, logprob=-float(token))
    return message


def test_queued_token_messages_fold_into_one_up_to_the_end_of_the_stream() -> None:
    async def scenario() -> list[object]:
        request = Request("r", [1, 2], SamplingParams(max_tokens=3))
        stream = OutputStream(request, None)
        stream.send(_message([5], "a"))
        stream.send(_message([6, 7], "bc"))
        request.finish_reason = FinishReason.LENGTH
        stream.close(_message([8], "d"))
        return [await stream.next_item(), await stream.next_item()]

    folded, end = asyncio.run(scenario())
    assert isinstance(folded, pb.GenerateResponse)
    assert list(folded.token_ids) == [5, 6, 7, 8] and folded.text == "abcd"
    assert [l.token_id for l in folded.logprobs] == [5, 6, 7, 8]
    assert folded.finish_reason == pb.FINISH_REASON_LENGTH
    assert end is None


def test_an_error_is_never_folded_into_the_tokens_before_it() -> None:
    async def scenario() -> list[object]:
        stream = OutputStream(Request("r", [1], SamplingParams()), None)
        stream.send(_message([5], "a"))
        stream.fail(RequestError(ErrorKind.INTERNAL, "lost"))
        return [await stream.next_item(), await stream.next_item()]

    first, second = asyncio.run(scenario())
    assert isinstance(first, pb.GenerateResponse) and list(first.token_ids) == [5]
    assert second == RequestError(ErrorKind.INTERNAL, "lost")


def test_a_stream_interval_sends_the_first_token_at_once_then_gathers_tokens() -> None:
    async def scenario() -> list[object]:
        request = Request("r", [1, 2], SamplingParams(max_tokens=9))
        stream = OutputStream(request, None, stream_interval=3)
        sent: list[object] = []

        async def drain() -> None:
            while (item := await stream.next_item()) is not None:
                sent.append(item)

        servicer = asyncio.create_task(drain())
        for token in range(5, 11):
            stream.send(_message([token], str(token)))
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        released = [list(m.token_ids) for m in sent]
        request.finish_reason = FinishReason.LENGTH
        stream.close(_message([11], "11"))
        await servicer
        return [released, sent]

    released, sent = asyncio.run(scenario())
    # The first token alone, then three at a time; the last two wait for the end, which
    # takes them along with its own token.
    assert released == [[5], [6, 7, 8]]
    assert [list(m.token_ids) for m in sent] == [[5], [6, 7, 8], [9, 10, 11]]
    assert sent[-1].text == "91011" and sent[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_tokens_that_leave_early_with_a_group_do_not_count_towards_the_next() -> None:
    async def scenario() -> list[list[int]]:
        request = Request("r", [1], SamplingParams(max_tokens=9))
        stream = OutputStream(request, None, stream_interval=3)
        sent: list[list[int]] = []

        async def drain() -> None:
            while (item := await stream.next_item()) is not None:
                sent.append(list(item.token_ids))

        servicer = asyncio.create_task(drain())
        stream.send(_message([5], "a"))
        await asyncio.sleep(0)
        for token in (6, 7, 8, 9):  # the fourth arrives before the servicer takes the group
            stream.send(_message([token], "b"))
        for token in (10, 11, 12):
            await asyncio.sleep(0)
            stream.send(_message([token], "c"))
        await asyncio.sleep(0)
        groups = list(sent)
        request.finish_reason = FinishReason.LENGTH
        stream.close()
        await servicer
        return groups

    assert asyncio.run(scenario()) == [[5], [6, 7, 8, 9], [10, 11, 12]]
