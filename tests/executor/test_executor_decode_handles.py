"""Steady decodes named by handle (StepPlan.decode_handles) on a ModelRunner in this process:
they compute what a continuing entry of one token would, appended blocks land where the plan
says, and a handle the executor does not hold, or a decode that is not steady, is answered
without running anything of that request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_service.runner.model_runner import ModelRunner
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from protos.limits import UNHELD_DECODE_TOKEN
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.model_factory import build_model

BLOCK_SIZE = 4
PROMPT = [5, 6, 7]


@pytest.fixture()
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    torch.set_num_threads(1)
    model_dir: Path = build_model("llama", tmp_path_factory.mktemp("llama"))
    settings = ExecutorSettings(model_dir=model_dir, device="cpu", num_kv_blocks=16, block_size=BLOCK_SIZE)
    return build_executor(settings).runner


def _new(request_id: str, block: int, handle: int = 0) -> pb.NewRequest:
    return pb.NewRequest(
        request_id=request_id,
        token_ids=PROMPT,
        block_ids=[block],
        num_scheduled_tokens=len(PROMPT),
        sampling=pb.SamplerConfig(temperature=0),
        handle=handle,
    )


def test_decodes_by_handle_equal_continuing_entries_across_a_block_append(runner: ModelRunner) -> None:
    first = runner.execute(pb.StepPlan(step_id=1, new_requests=[_new("listed", 0), _new("bulk", 1, handle=7)]))
    listed = [first.outputs[0].token_ids[0]]
    bulk = [first.outputs[1].token_ids[0]]
    # Positions 3..6: position 4 needs a second block, appended in the plan of step 3.
    for step in range(2, 6):
        plan = pb.StepPlan(step_id=step, decode_handles=[7])
        extra = []
        if step == 3:
            plan.decode_block_handles.append(7)
            plan.decode_block_ids.append(3)
            extra = [2]
        plan.continuing_requests.add(request_id="listed", num_scheduled_tokens=1, new_block_ids=extra)
        result = runner.execute(plan)
        assert not result.rejected and not result.HasField("failure")
        assert [o.request_id for o in result.outputs] == ["listed"]
        listed.append(result.outputs[0].token_ids[0])
        bulk += result.decode_token_ids
    assert bulk == listed
    assert runner.requests["bulk"].block_ids == [1, 3]


def test_an_unheld_handle_is_answered_in_its_place_and_others_run(runner: ModelRunner) -> None:
    runner.execute(pb.StepPlan(step_id=1, new_requests=[_new("a", 0, handle=1)]))
    result = runner.execute(pb.StepPlan(step_id=2, decode_handles=[9, 1]))
    assert result.decode_token_ids[0] == UNHELD_DECODE_TOKEN
    assert result.decode_token_ids[1] != UNHELD_DECODE_TOKEN
    runner.execute(pb.StepPlan(step_id=3, dropped_request_ids=["a"]))
    assert runner.handles == {}
    result = runner.execute(pb.StepPlan(step_id=4, decode_handles=[1]))
    assert list(result.decode_token_ids) == [UNHELD_DECODE_TOKEN] and not result.outputs


def test_a_decode_that_is_not_steady_or_lacks_room_is_refused_by_request_id(runner: ModelRunner) -> None:
    half = _new("half", 0, handle=1)
    half.num_scheduled_tokens = 1
    runner.execute(pb.StepPlan(step_id=1, new_requests=[half, _new("full", 1, handle=2)]))
    # "half" has two prompt tokens left to compute. "full" computes its fourth token into the
    # last slot of its block, then has no room for a fifth, and the plan gives it no block.
    result = runner.execute(pb.StepPlan(step_id=2, decode_handles=[1, 2]))
    assert [r.request_id for r in result.rejected] == ["half"]
    assert "steady decode" in result.rejected[0].message
    assert result.decode_token_ids[0] == UNHELD_DECODE_TOKEN
    result = runner.execute(pb.StepPlan(step_id=3, decode_handles=[2]))
    assert [r.request_id for r in result.rejected] == ["full"]
    assert "do not fit" in result.rejected[0].message
    assert list(result.decode_token_ids) == [UNHELD_DECODE_TOKEN] and runner.handles == {}


def test_a_block_outside_the_pool_or_already_held_is_refused(runner: ModelRunner) -> None:
    runner.execute(pb.StepPlan(step_id=1, new_requests=[_new("a", 0, handle=1), _new("b", 1, handle=2)]))
    result = runner.execute(
        pb.StepPlan(step_id=2, decode_handles=[1, 2], decode_block_handles=[1, 2], decode_block_ids=[99, 1])
    )
    assert sorted(r.request_id for r in result.rejected) == ["a", "b"]
    assert list(result.decode_token_ids) == [UNHELD_DECODE_TOKEN, UNHELD_DECODE_TOKEN]


def test_a_handle_in_use_names_its_request(runner: ModelRunner) -> None:
    runner.execute(pb.StepPlan(step_id=1, new_requests=[_new("a", 0, handle=1)]))
    result = runner.execute(pb.StepPlan(step_id=2, new_requests=[_new("b", 1, handle=1)]))
    assert [r.request_id for r in result.rejected] == ["b"] and "names request 'a'" in result.rejected[0].message
    assert runner.handles[1].request_id == "a"
