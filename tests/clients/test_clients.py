"""The Python client library: request building, and real gRPC calls against a fake servicer that
exists only to exercise the client (streaming, result assembly, errors, cancellation)."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from clients import AsyncClient, Client, SplitserveError
from clients.cli import main as cli_main
from clients.request_builder import build_generate_request, build_tokenize_request
from protos.splitserve.v1 import generation_pb2 as pb
from protos.splitserve.v1 import generation_pb2_grpc as pb_grpc

OPTIONAL_SAMPLING_FIELDS = [
    "max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs"
]
FIXED_PIECES = [([9906], "Hello"), ([11, 1917], ", world"), ([0], "!")]


# --- request building -------------------------------------------------------------------------


def test_every_argument_lands_in_its_field() -> None:
    request = build_generate_request(
        "Hi",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 3],
        logit_bias={5: -100.0, 9: 2.5},
        allowed_token_ids=[5, 9, 11],
        ignore_eos=True,
        logprobs=2,
        min_tokens=1,
        skip_special_tokens=False,
        priority=-3,
        request_id="r-1",
        cache_salt="tenant-a",
    )
    expected = pb.GenerateRequest(
        request_id="r-1",
        text="Hi",
        priority=-3,
        cache_salt="tenant-a",
        sampling=pb.SamplingParams(
            max_tokens=7,
            min_tokens=1,
            temperature=0.5,
            top_k=40,
            top_p=0.9,
            min_p=0.05,
            seed=1234,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            stop=["\n\n", "END"],
            stop_token_ids=[2, 3],
            logit_bias={5: -100.0, 9: 2.5},
            allowed_token_ids=[5, 9, 11],
            ignore_eos=True,
            logprobs=2,
            keep_special_tokens=True,
        ),
    )
    assert request == expected


def test_unset_arguments_stay_unset() -> None:
    request = build_generate_request("Hi")
    assert request.HasField("sampling")
    assert request.sampling == pb.SamplingParams()
    for name in OPTIONAL_SAMPLING_FIELDS:
        assert not request.sampling.HasField(name), name
    assert request.request_id == "" and request.cache_salt == "" and request.priority == 0


def test_zero_is_not_unset() -> None:
    sampling = build_generate_request("Hi", temperature=0.0, max_tokens=0, logprobs=0).sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0.0
    assert sampling.HasField("max_tokens") and sampling.HasField("logprobs")


def test_prompt_kinds() -> None:
    assert build_generate_request(prompt_token_ids=[1, 2, 3]).token_ids.ids == [1, 2, 3]
    from_tuples = build_generate_request(messages=[("system", "Be brief."), ("user", "Hi")])
    from_dicts = build_generate_request(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert from_tuples == from_dicts
    assert from_tuples.WhichOneof("prompt") == "chat"
    assert from_tuples.chat.add_generation_prompt
    assert [m.role for m in from_tuples.chat.messages] == ["system", "user"]
    no_prompt = build_generate_request(messages=[("user", "Hi")], add_generation_prompt=False)
    assert not no_prompt.chat.add_generation_prompt
    assert build_generate_request("Hi", stop="END").sampling.stop == ["END"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"prompt": "a", "prompt_token_ids": [1]},
        {"prompt": "a", "messages": [("user", "b")]},
        {"prompt_token_ids": [1], "messages": [("user", "b")]},
        {"messages": []},
        {"prompt": "a", "max_tokens": -1},
        {"prompt": "a", "top_k": 1.5},
        {"prompt_token_ids": [1, -2]},
        {"prompt": "a", "stop_token_ids": ["x"]},
        {"prompt": "a", "seed": -1},
    ],
)
def test_invalid_combinations_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        build_generate_request(**kwargs)  # type: ignore[arg-type]


def test_tokenize_requests() -> None:
    assert build_tokenize_request("abc") == pb.TokenizeRequest(text="abc")
    assert build_tokenize_request(messages=[("user", "x")]).chat.add_generation_prompt
    with pytest.raises(ValueError):
        build_tokenize_request()
    with pytest.raises(ValueError):
        build_tokenize_request("abc", [("user", "x")])


# --- real gRPC against a fake servicer ----------------------------------------------------------


class FakeGeneration(pb_grpc.GenerationServicer):
    """Streams fixed deltas, or misbehaves on request, and records what it saw."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        request_id = request.request_id or "server-assigned"
        if request.text == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0")
        if request.text in ("endless", "truncated"):
            ended_by_handler = threading.Event()
            # Once the client cancels, grpc may never resume this generator, so the cancellation
            # is seen by the termination callback rather than by the loop below.
            context.add_callback(lambda: ended_by_handler.is_set() or self.cancelled.set())
            yield pb.GenerateResponse(request_id=request_id, token_ids=[1], text="a")
            deadline = time.monotonic() + 10
            while request.text == "endless" and context.is_active():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            if not context.is_active():
                self.cancelled.set()
            ended_by_handler.set()
            return
        want_logprobs = request.sampling.HasField("logprobs")
        for i, (ids, text) in enumerate(FIXED_PIECES):
            response = pb.GenerateResponse(request_id=request_id, token_ids=ids, text=text)
            if want_logprobs:
                response.logprobs.extend(pb.TokenLogprob(token_id=t, logprob=-0.5) for t in ids)
            if i == len(FIXED_PIECES) - 1:
                response.finish_reason = pb.FINISH_REASON_STOP
                response.stop_reason = "\n"
                response.usage.CopyFrom(pb.Usage(prompt_tokens=5, completion_tokens=4))
                response.timings.CopyFrom(pb.Timings(total_s=0.25, num_preemptions=1))
            yield response

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=request.request_id == "known")

    def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.ServicerContext
    ) -> pb.TokenizeResponse:
        if request.WhichOneof("input") == "chat":
            return pb.TokenizeResponse(token_ids=[len(request.chat.messages)], tokens=["chat"])
        text = request.text
        return pb.TokenizeResponse(token_ids=[ord(c) for c in text], tokens=list(text))

    def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> pb.ModelInfo:
        return pb.ModelInfo(model_id="fake-model", vocab_size=100, eos_token_ids=[2])

    def GetServerStatus(
        self, request: pb.GetServerStatusRequest, context: grpc.ServicerContext
    ) -> pb.ServerStatus:
        return pb.ServerStatus(num_waiting=2, policy="fcfs")


@pytest.fixture
def fake() -> Iterator[tuple[str, FakeGeneration]]:
    servicer = FakeGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def test_generate_assembles_the_stream(fake: tuple[str, FakeGeneration]) -> None:
    address, servicer = fake
    with Client(address, timeout=10, metadata=[("authorization", "Bearer t0k")]) as client:
        result = client.generate("Hi", max_tokens=4, temperature=0.0, request_id="r-7")

    assert result.request_id == "r-7"
    assert result.text == "Hello, world!"
    assert result.token_ids == [9906, 11, 1917, 0]
    assert (result.finish_reason, result.stop_reason) == ("stop", "\n")
    assert result.usage is not None and result.usage.prompt_tokens == 5
    assert result.usage.completion_tokens == 4 and result.usage.cached_prompt_tokens == 0
    assert result.timings is not None and result.timings.num_preemptions == 1
    assert result.logprobs is None
    sent = servicer.requests[0]
    assert sent.sampling.max_tokens == 4 and sent.sampling.HasField("temperature")
    assert not sent.sampling.HasField("top_p")
    assert servicer.metadata[0]["authorization"] == "Bearer t0k"


def test_stream_yields_deltas_with_usage_on_the_last(fake: tuple[str, FakeGeneration]) -> None:
    address, _ = fake
    with Client(address) as client:
        deltas = list(client.stream(messages=[("user", "Hi")], logprobs=0))

    assert [d.text for d in deltas] == ["Hello", ", world", "!"]
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert deltas[-1].request_id == "server-assigned"
    assert all(d.usage is None for d in deltas[:-1]) and deltas[-1].usage is not None
    assert [lp.token_id for d in deltas for lp in d.logprobs] == [9906, 11, 1917, 0]


def test_logprobs_are_collected_when_asked(fake: tuple[str, FakeGeneration]) -> None:
    with Client(fake[0]) as client:
        result = client.generate(prompt_token_ids=[1, 2], logprobs=0)
    assert result.logprobs is not None
    assert [lp.token_id for lp in result.logprobs] == result.token_ids


def test_server_errors_become_splitserve_errors(fake: tuple[str, FakeGeneration]) -> None:
    with Client(fake[0]) as client:
        with pytest.raises(SplitserveError) as raised:
            client.generate("invalid")
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details == "temperature must be >= 0"


def test_a_stream_without_finish_is_an_error(fake: tuple[str, FakeGeneration]) -> None:
    with Client(fake[0]) as client:
        with pytest.raises(SplitserveError, match="finish reason"):
            client.generate("truncated")


def test_breaking_the_loop_cancels_the_call(fake: tuple[str, FakeGeneration]) -> None:
    address, servicer = fake
    with Client(address) as client:
        for delta in client.stream("endless"):
            assert delta.text == "a"
            break
        assert servicer.cancelled.wait(timeout=5)


def test_leaving_a_with_block_cancels_even_while_the_stream_is_referenced(
    fake: tuple[str, FakeGeneration],
) -> None:
    address, servicer = fake
    with Client(address) as client:
        with client.stream("endless") as deltas:
            assert next(deltas).text == "a"
        # `deltas` is still alive here, so only the explicit cancel can have ended the call.
        assert servicer.cancelled.wait(timeout=5)
        assert deltas.cancel() is False


def test_unary_calls(fake: tuple[str, FakeGeneration]) -> None:
    with Client(fake[0]) as client:
        assert client.abort("known") is True
        assert client.abort("unknown") is False
        tokens = client.tokenize("ab")
        assert (tokens.token_ids, tokens.tokens) == ([97, 98], ["a", "b"])
        assert client.tokenize(messages=[("user", "x")]).token_ids == [1]
        assert client.model_info().model_id == "fake-model"
        assert client.server_status().num_waiting == 2


def test_unreachable_server() -> None:
    with Client("127.0.0.1:1", timeout=2) as client:
        with pytest.raises(SplitserveError) as raised:
            client.model_info()
    assert raised.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_async_client(fake: tuple[str, FakeGeneration]) -> None:
    address, servicer = fake

    async def scenario() -> None:
        async with AsyncClient(address, timeout=10) as client:
            result = await client.generate("Hi", max_tokens=3)
            assert (result.text, result.finish_reason) == ("Hello, world!", "stop")
            texts = [delta.text async for delta in client.stream(prompt_token_ids=[5])]
            assert texts == ["Hello", ", world", "!"]
            with pytest.raises(SplitserveError) as raised:
                await client.generate("invalid")
            assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert await client.abort("known")
            assert (await client.tokenize("a")).token_ids == [97]
            assert (await client.model_info()).vocab_size == 100
            assert (await client.server_status()).policy == "fcfs"
            with pytest.raises(ValueError):
                client.stream()
            async for _ in client.stream("endless"):
                break
            assert await asyncio.to_thread(servicer.cancelled.wait, 5)
            servicer.cancelled.clear()
            async with client.stream("endless") as deltas:
                assert (await anext(deltas)).text == "a"
            assert await asyncio.to_thread(servicer.cancelled.wait, 5)

    asyncio.run(scenario())


def test_both_clients_offer_the_same_calls_with_the_same_signatures() -> None:
    """The asyncio client is the blocking one awaited: every public method on both, the same
    parameters, defaults and annotations, a coroutine where the blocking one returns its result
    (stream() excepted: both return their stream at once)."""

    def public(cls: type) -> dict[str, object]:
        return {name: member for name, member in vars(cls).items() if not name.startswith("_") and callable(member)}

    blocking, awaited = public(Client), public(AsyncClient)
    assert set(blocking) == set(awaited)
    for name, method in blocking.items():
        other = awaited[name]
        assert inspect.signature(method).parameters == inspect.signature(other).parameters, name
        if name != "stream":
            assert inspect.iscoroutinefunction(other) and not inspect.iscoroutinefunction(method), name
    assert inspect.signature(Client.__init__) == inspect.signature(AsyncClient.__init__)


def test_trace_context_reaches_the_server_from_both_clients(fake: tuple[str, FakeGeneration]) -> None:
    address, servicer = fake
    context = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    with Client(address, timeout=10) as client:
        client.generate("Hi", max_tokens=3, trace_context=context)

    async def scenario() -> None:
        async with AsyncClient(address, timeout=10) as client:
            await client.generate("Hi", max_tokens=3, trace_context=context)

    asyncio.run(scenario())
    assert [sent.get("traceparent") for sent in servicer.metadata[-2:]] == [context["traceparent"]] * 2


def test_cli_generate_streams_text(
    fake: tuple[str, FakeGeneration], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = fake
    assert cli_main(["generate", "--server", address, "--max-tokens", "4", "--chat", "Hi"]) == 0
    assert capsys.readouterr().out == "Hello, world!\n"
    sent = servicer.requests[0]
    assert sent.chat.messages[0].content == "Hi" and sent.chat.add_generation_prompt
    assert sent.sampling.max_tokens == 4 and not sent.sampling.HasField("temperature")


def test_cli_status_tokenize_and_errors(
    fake: tuple[str, FakeGeneration], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = fake
    assert cli_main(["status", "--server", address]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["modelId"] == "fake-model" and report["server"]["numWaiting"] == 2
    assert cli_main(["tokenize", "--server", address, "ab"]) == 0
    assert json.loads(capsys.readouterr().out) == {"token_ids": [97, 98], "tokens": ["a", "b"]}
    assert cli_main(["generate", "--server", address, "invalid"]) == 1
    assert "INVALID_ARGUMENT: temperature must be >= 0" in capsys.readouterr().err
