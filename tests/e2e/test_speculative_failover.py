"""Speculative decoding through an executor's death, real processes: the executor is SIGKILLed
while requests speculate (the scheduler's ngram drafts, or its own draft model's) and a fresh
one starts on its address. Drafts in flight die with it; the scheduler recomputes every request
from the tokens already streamed, the new executor's draft model catches up on them, and every
client gets exactly the tokens of an undisturbed run without speculation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from executor_service.truncated_draft import truncate
from protos.splitserve.v1.generation_pb2 import EXECUTOR_STATE_UP
from tests.e2e.test_speculative_decoding import EXECUTOR_FLAGS, _prompts, model  # noqa: F401 (a fixture)
from tests.helpers.executor_kill import stream_through_executor_kill
from tests.helpers.executor_process import start_executor
from tests.helpers.greedy_client import stream_all
from tests.helpers.scheduler_process import start_scheduler

MAX_TOKENS = 64


def _jobs() -> list[tuple[list[int], int]]:
    return [(prompt, MAX_TOKENS) for prompt in _prompts()]


@pytest.fixture(scope="module")
def undisturbed(model: Path) -> list[list[int]]:  # noqa: F811 (the imported fixture)
    with start_executor(model, **EXECUTOR_FLAGS) as (executor, _), start_scheduler(executor) as address:
        return asyncio.run(stream_all(address, _jobs()))


# The draft model's catch-up after the kill is make test-slow's; ngram's is make test's.
@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_an_executor_killed_while_requests_speculate_loses_no_token(
    model: Path, undisturbed: list[list[int]], method: str, tmp_path: Path  # noqa: F811 (the imported fixture)
) -> None:
    flags: dict[str, object] = dict(EXECUTOR_FLAGS)
    if method == "draft":
        flags["draft_model"] = truncate(model, tmp_path / "draft", layers=1)
    speculation = {"speculative_method": method, "num_speculative_tokens": 4}
    outputs, status = stream_through_executor_kill(model, _jobs(), kill_after_steps=12, scheduler_flags=speculation, **flags)
    assert outputs == undisturbed
    assert status.executors[0].state == EXECUTOR_STATE_UP
    # The kill came while requests were running: they were taken back and recomputed.
    assert status.num_preemptions >= 1
    assert status.kv_blocks_free == status.kv_blocks_total
