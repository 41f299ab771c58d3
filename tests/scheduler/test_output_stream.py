"""A stream that fell behind catches up in one message: the tokens, text and logprobs of the
messages queued behind the next one are folded into it, in order, and nothing else is. They are
folded as they arrive, so a backlog costs bytes per token, and it is bounded: a reader that falls
further behind than the limits is ended with its backlog dropped. A finished call drops what its
client did not read. With a stream interval, tokens leave in groups, the first token and the end
at once. Several tokens added at once (a step's accepted drafts) answer what they would one at a
time: a stop string ends the message on the token that completed it."""

import asyncio
import tracemalloc
from pathlib import Path

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestError
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.frontend.output_stream import OutputStream
from scheduler_service.frontend.stream_backlog import BacklogLimits
from scheduler_service.text.detokenizer import StringStop
from scheduler_service.text.tokenizer import TextProcessor
from tests.helpers.letter_tokenizer import letter_tokenizer_dir

UNBOUNDED = BacklogLimits(max_tokens=10**9, max_bytes=10**12)


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


def _with_top_logprobs(token: int, text: str, top: int = 20) -> pb.GenerateResponse:
    message = pb.GenerateResponse(request_id="r", token_ids=[token], text=text)
    entry = message.logprobs.add(token_id=token, logprob=-1.5, token_bytes=text.encode())
    entry.top_token_ids.extend(range(top))
    entry.top_logprobs.extend([-0.5] * top)
    entry.top_token_bytes.extend([b"tok"] * top)
    return message


def test_folding_keeps_multibyte_text_logprobs_and_the_end_in_order() -> None:
    async def scenario() -> tuple[object, object]:
        request = Request("r", [1], SamplingParams(max_tokens=3))
        stream = OutputStream(request, None)
        stream.send(_with_top_logprobs(5, "a"))
        first = await stream.next_item()
        stream.send(_with_top_logprobs(6, "é"))
        stream.send(_with_top_logprobs(7, "日本"))
        request.finish_reason = FinishReason.LENGTH
        stream.close(_with_top_logprobs(8, "🙂"))
        return first, await stream.next_item()

    first, folded = asyncio.run(scenario())
    assert isinstance(first, pb.GenerateResponse) and list(first.token_ids) == [5]
    assert isinstance(folded, pb.GenerateResponse)
    assert folded.request_id == "r"
    assert list(folded.token_ids) == [6, 7, 8] and folded.text == "é日本🙂"
    assert [entry.token_bytes.decode() for entry in folded.logprobs] == ["é", "日本", "🙂"]
    assert all(len(entry.top_token_ids) == 20 for entry in folded.logprobs)
    assert folded.finish_reason == pb.FINISH_REASON_LENGTH and folded.usage.completion_tokens == 0


def _unread_backlog_bytes(stream: OutputStream, tokens: int) -> int:
    """What Python allocates while the stream holds tokens its reader has not taken."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for token in range(tokens):
            stream.send(pb.GenerateResponse(request_id="r", token_ids=[token % 1000], text="ab"))
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_an_unread_backlog_costs_bytes_per_token_not_a_message_per_step() -> None:
    stream = OutputStream(Request("r", [1], SamplingParams()), None, backlog=UNBOUNDED)
    tokens = 20_000
    per_token = _unread_backlog_bytes(stream, tokens) / tokens
    # Each token is ~6 bytes on the wire; a message per step held ~80 bytes of Python object
    # here (and ~1.6 KB with its upb arena, which tracemalloc does not see).
    assert per_token < 16, f"{per_token:.1f} bytes per unread token"


def test_a_finished_call_drops_what_its_client_did_not_read() -> None:
    stream = OutputStream(Request("r", [1], SamplingParams()), None, backlog=UNBOUNDED)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for token in range(20_000):
            stream.send(pb.GenerateResponse(request_id="r", token_ids=[token % 1000], text="ab"))
        held = tracemalloc.get_traced_memory()[0] - before
        stream.discard()
        # The stream object itself is still referenced here, as grpc's cycles keep it.
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held > 50_000 and left < held / 20, (held, left)


def test_a_reader_further_behind_than_the_token_limit_is_ended_and_its_backlog_dropped() -> None:
    async def scenario() -> tuple[list[RequestError], object, object]:
        ended: list[RequestError] = []

        def end_request(error: RequestError) -> None:
            ended.append(error)
            stream.fail(error)

        stream = OutputStream(
            Request("slow", [1], SamplingParams()), None, backlog=BacklogLimits(max_tokens=10),
            on_backlog_exceeded=end_request,
        )
        token = 5
        while not stream.closed:
            stream.send(_message([token], "x"))
            token += 1
        return ended, await stream.next_item(), await stream.next_item()

    ended, first, second = asyncio.run(scenario())
    # Eleven tokens unread: ended once, with none of them sent before the error.
    assert len(ended) == 1 and first == ended[0] == second
    assert isinstance(first, RequestError) and first.kind is ErrorKind.OVERLOADED
    assert "read too slowly" in first.message and "11 tokens" in first.message
    assert "--max-stream-backlog-tokens 10" in first.message


def test_a_reader_further_behind_than_the_byte_limit_is_ended() -> None:
    async def scenario() -> tuple[int, object]:
        stream = OutputStream(Request("r", [1], SamplingParams()), None, backlog=BacklogLimits(max_bytes=2000))
        sent = 0
        while not stream.closed:
            stream.send(_with_top_logprobs(sent, "x"))
            sent += 1
        return sent, await stream.next_item()

    sent, error = asyncio.run(scenario())
    # About 200 bytes a token with 20 top logprobs.
    assert 5 <= sent <= 12, sent
    assert isinstance(error, RequestError) and error.kind is ErrorKind.OVERLOADED
    assert "--max-stream-backlog-bytes 2000" in error.message


def test_a_reader_that_keeps_up_is_never_ended_even_with_a_stream_interval_at_the_limit() -> None:
    async def scenario() -> list[int]:
        request = Request("r", [1], SamplingParams(max_tokens=200))
        stream = OutputStream(request, None, stream_interval=8, backlog=BacklogLimits(max_tokens=8))
        received: list[int] = []

        async def read() -> None:
            while isinstance(item := await stream.next_item(), pb.GenerateResponse):
                received.extend(item.token_ids)

        reader = asyncio.create_task(read())
        for token in range(200):
            stream.send(_message([token], "t"))
            await asyncio.sleep(0)
        request.finish_reason = FinishReason.LENGTH
        stream.close()
        await reader
        return received

    assert asyncio.run(scenario()) == list(range(200))


def test_every_field_of_the_executors_logprob_record_reaches_the_client() -> None:
    """Records are copied field by field, not round-tripped through bytes: a field added to the
    executor's record must be copied too."""
    record = executor_pb2.TokenLogprob()
    for field in record.DESCRIPTOR.fields:
        value = {"token_id": 5, "top_token_ids": 7}.get(field.name, -0.25)
        if field.is_repeated:
            getattr(record, field.name).extend([value, value])
        else:
            setattr(record, field.name, value)
    stream = OutputStream(Request(request_id="r", prompt_token_ids=[1], sampling=SamplingParams()), None)
    message, _ = stream.add_tokens([5], [record])
    (copied,) = message.logprobs
    for field in record.DESCRIPTOR.fields:
        assert getattr(copied, field.name) == getattr(record, field.name), field.name


def test_a_stop_string_completed_inside_several_tokens_ends_the_message_on_its_last_token(tmp_path: Path) -> None:
    """Prompt "ab", then c d e f in one update (their records led by the prompt's score) with
    the stop string "de": the message answers c d e and their records, as one token at a time
    would have, where the stop string ended the request at e and f was never sampled."""
    text = TextProcessor.from_pretrained(letter_tokenizer_dir(tmp_path / "letters", vocab_size=16))
    prompt, (c, d, e, f) = [3, 4], [5, 6, 7, 8]
    sampling = SamplingParams(stop=("de",), logprobs=0, prompt_logprobs=0)

    def record(token: int) -> executor_pb2.TokenLogprob:
        return executor_pb2.TokenLogprob(token_id=token, logprob=-float(token))

    at_once = OutputStream(Request("r", prompt, sampling), text)
    message, stop = at_once.add_tokens([c, d, e, f], [record(4), *map(record, [c, d, e, f])])

    assert stop == StringStop("de", 3)
    assert list(message.token_ids) == [c, d, e] and message.text == "c"
    assert [r.token_id for r in message.logprobs] == [c, d, e]
    assert [r.token_id for r in message.prompt_logprobs] == [4]

    one_at_a_time = OutputStream(Request("r", prompt, sampling), text)
    messages = [
        one_at_a_time.add_tokens(tokens, records)
        for tokens, records in [([c], [record(4), record(c)]), ([d], [record(d)]), ([e], [record(e)])]
    ]
    assert [stop is None for _, stop in messages] == [True, True, False]
    folded = pb.GenerateResponse()
    for each, _ in messages:
        folded.MergeFrom(each)
    folded.text = "".join(each.text for each, _ in messages)
    assert message == folded
