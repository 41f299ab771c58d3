"""A forward that raises is the failure of its step, not a lost executor: through real processes,
the request that makes it raise ends with INTERNAL and the executor's error, its neighbours in
the same steps finish with the right tokens, and the executor keeps serving.

The model is a random Llama whose folder ships its own modelling code (run with
--trust-remote-code): a subclass whose forward raises whenever the batch holds one chosen token,
which a victim request is steered to generate.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from clients import AsyncClient, Client
from clients.errors import SplitserveError
from executor_service.startup.self_check import (
    DECODE_STEPS,
    check_tokens,
    sequence_lengths,
)
from protos.splitserve.v1.generation_pb2 import EXECUTOR_STATE_UP
from tests.helpers.executor_process import start_executor
from tests.helpers.greedy_reference import Reference
from tests.helpers.model_factory import VOCAB_SIZE, build_model
from tests.helpers.scheduler_process import start_scheduler

torch.set_num_threads(1)
BLOCK_SIZE = 16
NUM_BLOCKS = 256
MAX_MODEL_LEN = 1024

POISONED_MODEL_CODE = '''
from transformers import LlamaForCausalLM


class PoisonedLlamaForCausalLM(LlamaForCausalLM):
    """Raises in every forward whose batch holds config.poison_token_id."""

    def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
        poison = self.config.poison_token_id
        if input_ids is not None and bool((input_ids == poison).any()):
            raise RuntimeError(f"poison token {poison} in the batch")
        return super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
'''
NEW_TOKENS = 24
PROMPT_LENGTHS = (3, 7, 12, 20, 33, 48)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("poisoned") / "llama", seed=5)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def jobs() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def poison(reference: Reference, jobs: list[list[int]]) -> tuple[int, int, int]:
    """(victim index, poison token, its output position): a token the victim generates after a
    few others and that nothing else ever feeds: no other prompt or output, and not the
    executor's start-up self-check."""
    len_a, len_b = sequence_lengths(BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, None)
    self_check = set(check_tokens(VOCAB_SIZE, len_a + len_b + 2 * DECODE_STEPS + 2))
    outputs = [reference(prompt, NEW_TOKENS) for prompt in jobs]
    for victim, output in enumerate(outputs):
        others = set(self_check)
        for other, (prompt, out) in enumerate(zip(jobs, outputs, strict=True)):
            if other != victim:
                others |= set(prompt) | set(out)
        for position in range(3, NEW_TOKENS - 4):
            token = output[position]
            if token not in others | set(jobs[victim]) | set(output[:position]):
                return victim, token, position
    pytest.fail("no request generates a token that appears nowhere else")


@pytest.fixture(scope="module")
def service(
    model_dir: Path, poison: tuple[int, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    (model_dir / "poisoned_llama.py").write_text(POISONED_MODEL_CODE)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "poisoned_llama.PoisonedLlamaForCausalLM"}
    config["poison_token_id"] = poison[1]
    config_path.write_text(json.dumps(config))
    # transformers copies remote code into a modules cache; keep it out of the user's home.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf_modules")))
        with start_executor(
            model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, trust_remote_code=True
        ) as (executor, _):
            with start_scheduler(executor) as address:
                yield address


async def _run_all(address: str, prompts: list[list[int]]) -> list[list[int] | SplitserveError]:
    async with AsyncClient(address) as client:

        async def one(prompt: list[int]) -> list[int] | SplitserveError:
            tokens: list[int] = []
            try:
                async for delta in client.stream(
                    prompt_token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True
                ):
                    tokens.extend(delta.token_ids)
            except SplitserveError as error:
                error.streamed = tokens  # type: ignore[attr-defined]
                return error
            return tokens

        return await asyncio.gather(*(one(p) for p in prompts))


def test_the_request_that_breaks_the_forward_fails_alone_and_the_executor_serves_on(
    service: str, reference: Reference, jobs: list[list[int]], poison: tuple[int, int, int]
) -> None:
    victim, token, position = poison
    results = asyncio.run(_run_all(service, jobs))
    for index, (prompt, result) in enumerate(zip(jobs, results, strict=True)):
        expected = reference(prompt, NEW_TOKENS)
        if index == victim:
            assert isinstance(result, SplitserveError), result
            assert result.code == grpc.StatusCode.INTERNAL
            assert f"poison token {token} in the batch" in result.details
            assert "lost" not in result.details
            # What was streamed before the failure is the true start of the answer.
            assert result.streamed == expected[: len(result.streamed)]  # type: ignore[attr-defined]
            assert len(result.streamed) == position + 1  # type: ignore[attr-defined]
        else:
            assert result == expected, f"request {index}"
    # The same executor process serves the next requests, never reported lost.
    again = asyncio.run(_run_all(service, [p for i, p in enumerate(jobs) if i != victim]))
    assert again == [reference(p, NEW_TOKENS) for i, p in enumerate(jobs) if i != victim]
    with Client(service) as client:
        status = client.server_status()
    assert status.executors[0].state == EXECUTOR_STATE_UP
    assert status.kv_blocks_free == status.kv_blocks_total
