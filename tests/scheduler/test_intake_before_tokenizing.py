"""What Intake refuses before any tokenizing (issue 43, item 4): a request over a byte cap, and a
text prompt whose length alone proves it cannot fit the model; what it must still tokenize."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.request import Request
from scheduler_service.frontend.intake_limits import IntakeLimits
from scheduler_service.frontend.request_intake import Intake
from scheduler_service.text.tokenizer import TextProcessor
from tests.helpers.tokenizer_assets import qwen3_tokenizer_dir

MiB = 1 << 20
MAX_MODEL_LEN = 4096


class Tokenized(AssertionError):
    """Raised by the tokenizer in the tests where the request must be refused before it."""


@pytest.fixture(scope="module")
def qwen3() -> TextProcessor:
    return TextProcessor.from_pretrained(qwen3_tokenizer_dir())


@pytest.fixture
def intake(qwen3: TextProcessor) -> Iterator[Intake]:
    opened = Intake(qwen3, IntakeLimits(max_prompt_bytes=MiB))
    yield opened
    opened.close()


@pytest.fixture
def no_tokenizing(qwen3: TextProcessor, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> list[int]:
        raise Tokenized("the prompt was tokenized")

    monkeypatch.setattr(qwen3, "encode", refuse)
    monkeypatch.setattr(qwen3, "encode_chat", refuse)


def submit(intake: Intake, message: pb.GenerateRequest) -> Request:
    info = executor_pb2.ExecutorInfo(vocab_size=151_936, max_model_len=MAX_MODEL_LEN, block_size=16, max_logprobs=20)
    return asyncio.run(intake.generate_request(message, info))


def sampling() -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=1)


@pytest.mark.usefixtures("no_tokenizing")
@pytest.mark.parametrize(
    "message",
    [
        pb.GenerateRequest(text="a" * (MiB + 1), sampling=sampling()),
        pb.GenerateRequest(text="é" * (MiB // 2 + 1), sampling=sampling()),
        pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="b" * (MiB // 2 + 1))] * 2), sampling=sampling()
        ),
    ],
    ids=["text", "multi-byte text", "chat"],
)
def test_a_prompt_over_the_byte_cap_is_refused_untokenized(intake: Intake, message: pb.GenerateRequest) -> None:
    with pytest.raises(RequestRejected, match="--max-prompt-bytes") as refused:
        submit(intake, message)
    assert refused.value.kind is ErrorKind.INVALID


@pytest.mark.usefixtures("no_tokenizing")
def test_a_text_too_long_for_the_model_by_its_length_alone_is_refused_untokenized(intake: Intake) -> None:
    # 128 bytes a token at the most (Qwen3's longest entry): 512 KiB of ASCII is 4,096 tokens or more.
    message = pb.GenerateRequest(text="x" * (MiB // 2), sampling=sampling())
    with pytest.raises(RequestRejected, match="at least 4096 tokens .* maximum model length of 4096") as refused:
        submit(intake, message)
    assert refused.value.kind is ErrorKind.INVALID


def test_a_text_one_token_short_of_the_bound_is_tokenized_and_fits(intake: Intake) -> None:
    # Runs of 128 spaces are single tokens: this prompt is exactly as short as the bound allows
    # and still fits, so the bound must not refuse it.
    fits = pb.GenerateRequest(text=" " * (MiB // 2 - 128), sampling=sampling())
    assert submit(intake, fits).num_prompt_tokens == MAX_MODEL_LEN - 1


def test_a_chat_is_never_judged_by_its_length(intake: Intake) -> None:
    # A template may drop what it is given, so only the tokens tell (the engine refuses these).
    turn = pb.ChatMessage(role="user", content="x" * (MiB // 2))
    message = pb.GenerateRequest(chat=pb.Chat(messages=[turn], add_generation_prompt=True), sampling=sampling())
    assert submit(intake, message).num_prompt_tokens >= MAX_MODEL_LEN
