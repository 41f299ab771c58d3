"""Drafts of a request with a grammar (ContinuingRequest.draft_bitmasks) on a ModelRunner in this
process, over a random Llama: each sampled position takes its own mask (the one for the last
token's position in allowed_token_bitmask, then one after each draft), so a request verified
with masked drafts answers exactly the tokens and logprobs of decoding one masked token a step,
greedy and seeded, whichever drafts are right."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from executor_service.runner.model_runner import ModelRunner
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.draft_blocks import grow_blocks
from tests.helpers.model_factory import VOCAB_SIZE, build_model

BLOCK_SIZE = 4
PROMPT = [5, 6, 7, 300, 41]
NEW_TOKENS = 24
GREEDY = pb.SamplerConfig(temperature=0, want_logprobs=True, num_logprobs=3)
SEEDED = pb.SamplerConfig(temperature=1.0, has_seed=True, seed=99, want_logprobs=True, num_logprobs=2)


def grammar(last: int) -> bytes:
    """A stand-in grammar whose next tokens depend on the last one: 1 in 3 of the vocabulary,
    shifted by it (so each position's mask differs from the one before)."""
    allowed = (np.arange(VOCAB_SIZE) + last) % 3 == 0
    return np.packbits(allowed, bitorder="little").tobytes()


def allows(last: int, token: int) -> bool:
    return (token + last) % 3 == 0


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    torch.set_num_threads(1)
    model: Path = build_model("llama", tmp_path_factory.mktemp("llama"))
    return build_executor(ExecutorSettings(model_dir=model, device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE)).runner


def _decode(runner: ModelRunner, sampling: pb.SamplerConfig, propose: Callable[[list[int]], list[int]]) -> tuple[list[int], list[bytes]]:
    """Tokens and logprob records of the request decoded with the drafts propose() gives
    after its tokens (none: one masked token a step)."""
    runner.drop_all_requests(wipe_kv=True)
    tokens: list[int] = []
    records: list[bytes] = []
    step = 1
    new = pb.NewRequest(
        request_id="r", token_ids=PROMPT, block_ids=range(16), num_scheduled_tokens=len(PROMPT), sampling=sampling,
        allowed_token_bitmask=grammar(PROMPT[-1]),
    )
    result = runner.execute(pb.StepPlan(step_id=step, new_requests=[new]))
    while True:
        assert not result.rejected, result.rejected[0].message
        output = result.outputs[0]
        tokens += output.token_ids
        records += [record.SerializeToString() for record in output.logprobs]
        if len(tokens) >= NEW_TOKENS:
            return tokens, records
        last = tokens[-1]
        drafts = propose([*PROMPT, *tokens])
        entry = pb.ContinuingRequest(
            request_id="r",
            num_scheduled_tokens=1 + len(drafts),
            allowed_token_bitmask=grammar(last),
            draft_token_ids=drafts,
            draft_bitmasks=[grammar(draft) for draft in drafts],
        )
        step += 1
        result = runner.execute(grow_blocks(runner, pb.StepPlan(step_id=step, continuing_requests=[entry])))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_masked_drafts_give_the_tokens_of_masked_decoding_one_at_a_time(runner: ModelRunner, sampling: pb.SamplerConfig) -> None:
    plain = _decode(runner, sampling, lambda tokens: [])
    reference = PROMPT + plain[0]
    assert all(allows(before, token) for before, token in zip(reference[len(PROMPT) - 1 :], plain[0]))

    def right_then_wrong(tokens: list[int]) -> list[int]:
        """The plain decode's next three tokens, then an allowed token that is not its fourth."""
        ahead = reference[len(tokens) : len(tokens) + 4]
        if len(ahead) < 4:
            return ahead[:3]
        wrong = next(t for t in range(VOCAB_SIZE) if allows(ahead[2], t) and t != ahead[3])
        return [*ahead[:3], wrong]

    masked = _decode(runner, sampling, right_then_wrong)
    assert masked[0][:NEW_TOKENS] == plain[0][:NEW_TOKENS]
    assert masked[1][:NEW_TOKENS] == plain[1][:NEW_TOKENS]
