"""A message on the plan stream that is not a StepPlan, through a real executor process: the stream
ends with INVALID_ARGUMENT saying so, one log line names the peer, and the executor serves on."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.executor_driver import PlanStream
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.executor_token import token_channel
from tests.helpers.model_factory import build_model

EXECUTE = "/splitserve.executor.v1.Executor/Execute"


def test_a_message_that_is_not_a_plan_ends_the_stream_with_invalid_argument(tmp_path: Path) -> None:
    executor = ExecutorProcess(build_model("llama", tmp_path / "llama"), num_kv_blocks=16, block_size=8)
    try:
        with token_channel(executor.wait_ready()) as channel:
            # Bytes as they go on the wire, so the second message can be anything at all.
            execute = channel.stream_stream(
                EXECUTE, request_serializer=lambda raw: raw, response_deserializer=pb.StepResult.FromString
            )
            messages = [pb.StepPlan(step_id=1).SerializeToString(), b"\xff\xff\xff\xff not a plan"]
            with pytest.raises(grpc.RpcError) as error:
                for _ in execute(iter(messages)):
                    pass
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "could not be parsed as a StepPlan" in error.value.details()
            # The executor serves on.
            stream = PlanStream(channel)
            new = pb.NewRequest(
                request_id="after", token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3
            )
            assert stream.step(pb.StepPlan(step_id=1, new_requests=[new])).outputs[0].token_ids
            stream.close()
        log = executor.log_text()
        assert log.count("event=plan_malformed") == 1, log
        # The reason is the parser's message, quoted as repr quotes it (either quote).
        assert re.search(r"event=plan_malformed peer=ipv4:127\.0\.0\.1:\d+ reason=[\'\"]\w", log), log
    finally:
        executor.close()
