"""The engine keeps the executor busy: plan N+1 is on the wire before result N is read."""

from __future__ import annotations

import asyncio
from pathlib import Path

from protos.splitserve.executor.v1 import executor_pb2 as pb
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.planner.executor_link import ExecutorLink
from tests.helpers.engine_in_process import engine_over
from tests.helpers.executor_process import start_executor
from tests.helpers.model_factory import build_model


class RecordingLink(ExecutorLink):
    """The real link to a real executor, noting the order of sends and reads."""

    def __init__(self, address: str, scheduler_id: str, token: str | None = None) -> None:
        super().__init__(address, scheduler_id, token=token)
        self.events: list[tuple[str, int]] = []

    async def send(self, plan: pb.StepPlan) -> None:
        self.events.append(("sent", plan.step_id))
        await super().send(plan)

    async def receive(self, timeout_s: float) -> pb.StepResult:
        result = await super().receive(timeout_s)
        self.events.append(("read", result.step_id))
        return result


def test_next_plan_is_sent_before_the_last_result_is_read(tmp_path: Path) -> None:
    model_dir = build_model("llama", tmp_path / "llama")

    async def scenario(address: str) -> list[tuple[str, int]]:
        async with engine_over(address, RecordingLink) as (engine, links):
            streams = [
                engine.submit(Request(f"r{i}", [5 + i] * (3 + i), SamplingParams(max_tokens=12, ignore_eos=True)))
                for i in range(4)
            ]
            for stream in streams:
                while await stream.next_item() is not None:
                    pass
        # The handshake (step 0) opens the stream; the steps that matter follow it.
        return [event for event in links[0].events if event[1] > 0]

    with start_executor(model_dir, num_kv_blocks=64, block_size=16) as (address, _):
        events = asyncio.run(scenario(address))
    reads = [step for kind, step in events if kind == "read"]
    assert len(reads) >= 12
    for step in reads[:-1]:
        sent_next = events.index(("sent", step + 1)) if ("sent", step + 1) in events else None
        assert sent_next is not None and sent_next < events.index(("read", step)), (
            f"step {step + 1} was planned only after result {step} was read: the executor idled"
        )
