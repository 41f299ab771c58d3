"""Unexpected exceptions inside a step, on a ModelRunner in this process: one entry's failure is
that entry's rejection; a failure of the shared forward is reported as the step's failure, drops
the requests of that step only, and is logged once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from executor_service.runner import model_runner
from executor_service.runner.model_runner import ModelRunner
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.model_factory import build_model

INTERNAL = 13


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    torch.set_num_threads(1)
    model_dir: Path = build_model("llama", tmp_path_factory.mktemp("llama"))
    settings = ExecutorSettings(model_dir=model_dir, device="cpu", num_kv_blocks=16, block_size=8)
    return build_executor(settings).runner


def _new(request_id: str, block: int) -> pb.NewRequest:
    return pb.NewRequest(
        request_id=request_id, token_ids=[5, 6, 7], block_ids=[block], num_scheduled_tokens=3
    )


def _raise_for(request_id: str, real: Callable[..., object]) -> Callable[..., object]:
    def new_state(rows: object, entry: pb.NewRequest, sampling: object, device: torch.device) -> object:
        if entry.request_id == request_id:
            raise RuntimeError("broken entry")
        return real(rows, entry, sampling, device)

    return new_state


def test_an_entry_that_raises_is_rejected_alone(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_runner, "_new_state", _raise_for("bad", model_runner._new_state))
    result = runner.execute(pb.StepPlan(step_id=1, new_requests=[_new("good", 0), _new("bad", 1)]))
    assert [(r.request_id, r.code) for r in result.rejected] == [("bad", INTERNAL)]
    assert "broken entry" in result.rejected[0].message
    assert [o.request_id for o in result.outputs] == ["good"]
    assert len(result.outputs[0].token_ids) == 1
    assert set(runner.requests) == {"good"}
    runner.execute(pb.StepPlan(step_id=2, dropped_request_ids=["good"]))


def test_a_failed_forward_fails_its_step_only_and_logs_once(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runner.execute(pb.StepPlan(step_id=1, new_requests=[_new("failed", 0), _new("idle", 1)]))

    def broken_forward(*args: object) -> torch.Tensor:
        raise RuntimeError("device fell over")

    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "compute_logits", broken_forward)
        decode = pb.ContinuingRequest(request_id="failed", num_scheduled_tokens=1)
        with caplog.at_level(logging.ERROR, logger=model_runner.__name__):
            result = runner.execute(pb.StepPlan(step_id=2, continuing_requests=[decode]))
    assert list(result.failure.request_ids) == ["failed"]
    assert result.failure.message == "RuntimeError: device fell over"
    assert not result.outputs
    # Only the failed step's request lost its state; the other one decodes on.
    assert set(runner.requests) == {"idle"}
    (record,) = [r for r in caplog.records if r.exc_info]
    assert "event=step_failed" in record.getMessage()
    after = runner.execute(
        pb.StepPlan(step_id=3, continuing_requests=[pb.ContinuingRequest(request_id="idle", num_scheduled_tokens=1)])
    )
    assert not after.HasField("failure") and len(after.outputs[0].token_ids) == 1
    runner.execute(pb.StepPlan(step_id=4, dropped_request_ids=["idle"]))
