"""Admin/Audit's path through a real engine and a real executor process: clean while requests
run mid-generation, and each mismatch a test injects is found and named (an executor that lost
a request, a block table that differs, a reference count off by one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from protos.splitserve.executor.v1 import executor_pb2 as pb
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.planner.executor_link import ExecutorLink
from tests.helpers.engine_in_process import engine_over
from tests.helpers.executor_process import start_executor
from tests.helpers.model_factory import build_model

torch.set_num_threads(1)


class TamperingLink(ExecutorLink):
    """The real link, rewriting what the executor says it holds, as a faulty executor would."""

    def __init__(self, address: str, scheduler_id: str, token: str | None = None) -> None:
        super().__init__(address, scheduler_id, token=token)
        self.hide: str | None = None
        self.shorten: str | None = None

    async def receive(self, timeout_s: float) -> pb.StepResult:
        result = await super().receive(timeout_s)
        kept = [held for held in result.held_requests if held.request_id != self.hide]
        for held in kept:
            if held.request_id == self.shorten:
                del held.block_ids[-1]
        del result.held_requests[:]
        result.held_requests.extend(kept)
        return result


def test_the_audit_is_clean_mid_generation_and_names_each_injected_mismatch(tmp_path: Path) -> None:
    model_dir = build_model("llama", tmp_path / "llama")

    async def scenario(address: str) -> list[list[str]]:
        async with engine_over(address, TamperingLink) as (engine, links):
            streams = [
                engine.submit(Request(f"r{i}", [5 + i] * (20 + i), SamplingParams(max_tokens=500, ignore_eos=True)))
                for i in range(3)
            ]
            for stream in streams:
                for _ in range(3):
                    await stream.next_item()
            found = []
            (clean,) = await engine.audit()
            assert clean.audited, clean
            found.append(list(clean.mismatches))
            links[0].hide, links[0].shorten = "r1", "r2"
            (tampered,) = await engine.audit()
            found.append(list(tampered.mismatches))
            links[0].hide = links[0].shorten = None
            lane = next(iter(engine.lanes.values()))
            block = lane.scheduler.kv.block_ids("r0")[0]
            lane.scheduler.kv.pool.blocks[block].ref_count += 1
            (corrupted,) = await engine.audit()
            found.append(list(corrupted.mismatches))
            lane.scheduler.kv.pool.blocks[block].ref_count -= 1
            engine.abort_all()
        return found

    with start_executor(model_dir, num_kv_blocks=64, block_size=16) as (address, _):
        clean, tampered, corrupted = asyncio.run(scenario(address))
    assert clean == []
    assert "request r1: placed on the executor, which does not hold it" in tampered
    assert any(line.startswith("request r2: block table") for line in tampered)
    assert len(tampered) == 2
    assert len(corrupted) == 1 and corrupted[0].startswith("block ") and "reference count 2, but 1 block tables name it ['r0']" in corrupted[0]
