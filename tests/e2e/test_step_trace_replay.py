"""The step trace and its replay, through real processes: a scheduler run with --trace-dir under
a workload with shared prefixes, staggered arrivals, preemption and an abort records its steps;
the replay, through the real scheduler core and the simulated executor fitted to the trace,
gives back the recorded schedule step for step when the configuration is unchanged, and other
configurations replay to a summary, JSON and a picture."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from clients import AsyncClient
from scheduler_service.replay.__main__ import main as replay_main
from scheduler_service.replay.fleet import replay_fleet
from scheduler_service.replay.simulate import config_of, replay_timeline
from scheduler_service.replay.step_cost import fit_step_cost
from scheduler_service.replay.trace_reader import read_trace
from tests.helpers.executor_process import start_executor
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess

torch.set_num_threads(1)


async def workload(address: str) -> None:
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(3)]
    async with AsyncClient(address) as client:

        async def one(index: int) -> None:
            prompt = prefixes[index % 3] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))]
            # One request asks for three choices, which fork from its prompt's computation.
            await client.generate(
                prompt_token_ids=prompt, max_tokens=rng.randrange(8, 60), temperature=0,
                ignore_eos=index % 2 == 0, priority=index % 3, n=3 if index == 4 else 1,
            )

        async def abandoned() -> None:
            async with client.stream(prompt_token_ids=prefixes[0] + [7, 8, 9], max_tokens=200, temperature=0, ignore_eos=True) as deltas:
                received = 0
                async for delta in deltas:
                    received += len(delta.token_ids)
                    if received >= 5:
                        break

        tasks = [asyncio.create_task(abandoned())]
        for wave in range(3):
            tasks += [asyncio.create_task(one(wave * 8 + i)) for i in range(8)]
            await asyncio.sleep(0.3)
        await asyncio.gather(*tasks)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("trace")
    model_dir = build_model("llama", folder / "llama", seed=9)
    with start_executor(model_dir, num_kv_blocks=24, block_size=16) as (executor, _):
        scheduler = SchedulerProcess(executor, trace_dir=folder / "steps", max_num_seqs=12, max_num_batched_tokens=128)
        try:
            asyncio.run(workload(scheduler.wait_ready()))
            assert scheduler.stop() == 0
        finally:
            scheduler.close()
    return folder / "steps"


def test_an_unchanged_configuration_replays_the_recorded_schedule_step_for_step(trace_dir: Path) -> None:
    (timeline,) = read_trace(trace_dir)
    events = [json.loads(line) for line in (trace_dir / "steps.jsonl").read_text().splitlines()]
    results = [e for e in events if e["e"] == "result"]
    assert results[-1]["preemptions"] > 0, "the pool was meant to be too small"
    assert results[-1]["hit_tokens"] > 0, "the prompts were meant to share prefixes"
    # The 24 blocks turned over more than once, and were all given back in the end.
    assert results[-1]["blocks_allocated"] > 24 and results[-1]["kv_used"] == 0
    assert all(a["blocks_allocated"] <= b["blocks_allocated"] for a, b in zip(results, results[1:]))
    assert any(e["e"] == "abort" for e in events)
    assert len(timeline.requests) == 27
    forks = [r for r in timeline.requests.values() if r.fork_of]
    assert len(forks) == 2 and forks[0].fork_of == forks[1].fork_of in timeline.requests
    cost = fit_step_cost(timeline.plans)
    replayed = replay_timeline(timeline, None, cost)
    assert replayed.num_recorded_steps == len(timeline.plans) > 20
    assert replayed.matched_steps == replayed.num_recorded_steps
    assert [s.signature for s in replayed.steps] == [p.signature for p in timeline.plans]
    # Token for token too: the later choices fork from the first's prompt as they did.
    replayed_tokens = [(s.prefill_tokens, s.decode_tokens) for s in replayed.steps]
    assert replayed_tokens == [(p.prefill_tokens, p.decode_tokens) for p in timeline.plans]
    recorded_outputs = {r.request_id: r.outputs for r in timeline.requests.values()}
    assert replayed.outputs == {i: n for i, n in recorded_outputs.items() if timeline.requests[i].finish != "abort"}


def test_the_chrome_trace_has_a_slice_per_step(trace_dir: Path) -> None:
    steps = [json.loads(line) for line in (trace_dir / "steps.jsonl").read_text().splitlines()]
    answered = [e["step"] for e in steps if e["e"] == "result"]
    events = json.loads((trace_dir / "trace.json").read_text())
    slices = [e["name"] for e in events if e["ph"] == "X"]
    # One slice per step the executor answered, heartbeats included. A plan still in flight when
    # the scheduler stopped has no result, so no slice: counting plans instead made this racy.
    assert slices == [f"step {step}" for step in answered] and len(answered) > 20
    assert {e["name"].split()[0] for e in events if e["ph"] == "C"} == {"queues", "kv"}


def test_other_configurations_replay_to_a_table_json_and_a_picture(
    trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replay.json"
    png = tmp_path / "replay.png"
    argv = [str(trace_dir), "--policy", "fcfs,priority", "--max-num-batched-tokens", "64,256", "--json", str(out), "--png", str(png)]
    assert replay_main(argv) == 0
    document = json.loads(out.read_text())
    labels = [c["label"] for c in document["configurations"]]
    assert labels == [
        "fcfs/mixed/tokens=64/seqs=12", "fcfs/mixed/tokens=256/seqs=12",
        "priority/mixed/tokens=64/seqs=12", "priority/mixed/tokens=256/seqs=12",
    ]
    for configuration in document["configurations"]:
        assert configuration["requests"] == 27 and configuration["output_tokens_per_s"] > 0
    assert document["step_cost"]["num_steps"] > 20
    assert png.stat().st_size > 20_000
    printed = capsys.readouterr().out
    assert "step cost fitted to" in printed and "mean abs error" in printed


def test_the_trace_replays_over_more_executors_with_every_request_routed(trace_dir: Path) -> None:
    (timeline,) = read_trace(trace_dir)
    config = config_of(timeline)
    replays = replay_fleet([timeline], config, fit_step_cost(timeline.plans), executors=2)
    assert all(r.steps for r in replays), "the router was meant to use both executors"
    arrived = {i for r in replays for i in r.arrival_s}
    assert arrived == set(timeline.requests)
    outputs = {i: n for r in replays for i, n in r.outputs.items()}
    # Every request that was not aborted ends as it did: at its length or its EOS.
    assert outputs == {i: r.outputs for i, r in timeline.requests.items() if r.finish != "abort"}
