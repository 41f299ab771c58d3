"""Generation/Detokenize in the servicer, with the real intake and Qwen3's tokenizer: text for
good ids (special tokens kept unless asked), INVALID_ARGUMENT for ids outside the vocabulary or
too many, FAILED_PRECONDITION without a tokenizer. (Through real processes and the gateway:
tests/clients/test_openai_gateway.py.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.frontend.intake_limits import IntakeLimits
from scheduler_service.frontend.request_intake import Intake
from scheduler_service.frontend.servicer import GenerationServicer
from scheduler_service.text.tokenizer import TextProcessor
from tests.helpers.tokenizer_assets import qwen3_tokenizer_dir

# The random test models' vocabulary for Qwen3's tokenizer, larger than the tokenizer's table.
MODEL_VOCAB_SIZE = 151_936


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


@pytest.fixture(scope="module")
def qwen3() -> TextProcessor:
    return TextProcessor.from_pretrained(qwen3_tokenizer_dir())


def detokenize(text: TextProcessor | None, request: pb.DetokenizeRequest, reached: bool = True) -> str:
    engine = SimpleNamespace(info=SimpleNamespace(vocab_size=MODEL_VOCAB_SIZE) if reached else None)
    intake = Intake(text, IntakeLimits(max_prompt_tokens=1000))
    servicer = GenerationServicer(engine, intake)  # type: ignore[arg-type]
    try:
        return asyncio.run(servicer.Detokenize(request, Context())).text  # type: ignore[arg-type]
    finally:
        intake.close()


def test_ids_become_text_with_their_special_tokens_unless_skipped(qwen3: TextProcessor) -> None:
    ids = qwen3.encode_chat([("user", "Hi there")], add_generation_prompt=True)

    assert detokenize(qwen3, pb.DetokenizeRequest(token_ids=ids)) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    skipped = pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=True)
    assert detokenize(qwen3, skipped) == "user\nHi there\nassistant\n"
    # Before any executor answered, the tokenizer's own table bounds the ids.
    assert detokenize(qwen3, pb.DetokenizeRequest(token_ids=ids), reached=False).startswith("<|im_start|>user")


@pytest.mark.parametrize(
    ("ids", "reason"),
    [
        # Inside the model's vocabulary, past the tokenizer's table: no text to give.
        ([9707, 151_700], "[151700] are outside the vocabulary of 151669"),
        ([9707, MODEL_VOCAB_SIZE + 5], "outside the vocabulary"),
        ([9707] * 1001, "at most 1000 are allowed (--max-prompt-tokens)"),
    ],
)
def test_bad_ids_are_invalid_arguments(qwen3: TextProcessor, ids: list[int], reason: str) -> None:
    with pytest.raises(Aborted) as aborted:
        detokenize(qwen3, pb.DetokenizeRequest(token_ids=ids))
    assert aborted.value.code is grpc.StatusCode.INVALID_ARGUMENT and reason in aborted.value.details


def test_without_a_tokenizer_it_is_a_failed_precondition() -> None:
    with pytest.raises(Aborted) as aborted:
        detokenize(None, pb.DetokenizeRequest(token_ids=[1, 2]))
    assert aborted.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "no tokenizer" in aborted.value.details
