"""Decode steps through decode graphs (decode_graphs.py) give what the eager path gives.

On the CPU the graphs' static path runs eagerly (EagerRecorder); where torch sees CUDA the same
tests capture and replay real CUDA graphs. Two runners of one model take the same plans, one
with graphs and one without, through prefills, decodes whose batch and context cross buckets,
steps that mix prefill and decode, and batches larger than any bucket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from executor_service.attention import paged_attention
from executor_service.runner import decode_graphs
from executor_service.runner.decode_graphs import (
    DecodeGraphs,
    EagerRecorder,
    GraphRecorder,
    Replay,
    batch_buckets,
    width_buckets,
)
from executor_service.runner.model_runner import ModelRunner
from executor_service.runner.plan_inputs import ScheduledWork
from executor_service.serving.metrics import ExecutorMetrics
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.executor_driver import BlockAllocator
from tests.helpers.model_factory import build_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_BATCH = 8
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
    ),
]


# Beside Llama: learned positions (GPT-2), soft-capping and a sliding window (Gemma 2), attention
# sinks (GPT-OSS), values narrower than keys (DeepSeek V3's latent attention), and a window
# shorter than the scenario's contexts (Mistral).
ARCHS: dict[str, dict[str, object]] = {
    "llama": {},
    "gpt2": {},
    "gemma2": {},
    "gpt_oss": {},
    "deepseek_v3": {},
    "mistral": {"sliding_window": 8},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: build_model(arch, tmp_path_factory.mktemp(arch), **fields) for arch, fields in ARCHS.items()}


@pytest.fixture(scope="module")
def model_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


def make_runner(model_dir: Path, device: str, graphed: bool) -> ModelRunner:
    settings = ExecutorSettings(
        model_dir=model_dir,
        device=device,
        dtype="float32",
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        threads=1,
        packed_linear=False,
        attention_backend="sdpa",
        cuda_graph_max_batch=MAX_BATCH if graphed else 0,
    )
    runner = build_executor(settings).runner
    if graphed and runner.graphs is None:
        attach_graphs(runner, EagerRecorder())
    assert (runner.graphs is not None) == graphed
    return runner


def attach_graphs(runner: ModelRunner, recorder: GraphRecorder) -> DecodeGraphs:
    """Gives the runner decode graphs of up to MAX_BATCH rows that capture through recorder."""
    runner.graphs = DecodeGraphs(runner.loaded, runner.kv_cache, MAX_BATCH, runner.limits.max_model_len, recorder)
    return runner.graphs


@dataclass(slots=True)
class _Sequence:
    computed: int
    blocks: list[int]


@dataclass(slots=True)
class PlanMaker:
    """Plans as a scheduler would send them: new requests prefilled whole, running ones
    decoding one token a step with blocks appended as their context grows. by_handle: decodes
    go as steady decodes named by handle (what the scheduler sends), else as continuing
    entries."""

    by_handle: bool = False
    allocator: BlockAllocator = field(default_factory=lambda: BlockAllocator(NUM_BLOCKS))
    running: dict[str, _Sequence] = field(default_factory=dict)
    handles: dict[str, int] = field(default_factory=dict)
    step_id: int = 0

    def plan(self, new: dict[str, list[int]], drop: tuple[str, ...] = ()) -> pb.StepPlan:
        self.step_id += 1
        plan = pb.StepPlan(step_id=self.step_id, dropped_request_ids=drop)
        for request_id in drop:
            self.allocator.give_back(self.running.pop(request_id).blocks)
        for request_id, sequence in self.running.items():
            wanted = -(-(sequence.computed + 1) // BLOCK_SIZE) - len(sequence.blocks)
            added = self.allocator.take(max(0, wanted))
            sequence.blocks += added
            sequence.computed += 1
            if self.by_handle:
                handle = self.handles[request_id]
                plan.decode_handles.append(handle)
                plan.decode_block_handles.extend([handle] * len(added))
                plan.decode_block_ids.extend(added)
            else:
                plan.continuing_requests.add(request_id=request_id, num_scheduled_tokens=1, new_block_ids=added)
        for request_id, prompt in new.items():
            blocks = self.allocator.take(-(-len(prompt) // BLOCK_SIZE))
            self.running[request_id] = _Sequence(len(prompt), blocks)
            self.handles[request_id] = self.step_id * 100 + len(plan.new_requests) + 1
            plan.new_requests.add(
                request_id=request_id,
                token_ids=prompt,
                block_ids=blocks,
                num_scheduled_tokens=len(prompt),
                handle=self.handles[request_id],
            )
        return plan

    def tokens_of(self, plan: pb.StepPlan, result: pb.StepResult) -> dict[str, list[int]]:
        """Each request's tokens in the result, from its outputs and its decode tokens."""
        assert not result.HasField("failure") and not result.rejected
        tokens = {output.request_id: list(output.token_ids) for output in result.outputs}
        names = {handle: request_id for request_id, handle in self.handles.items()}
        for handle, token in zip(plan.decode_handles, result.decode_token_ids, strict=True):
            tokens[names[handle]] = [token]
        return tokens


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


# (new requests by prompt length, requests dropped, decode steps after it)
SCENARIO: list[tuple[dict[str, int], tuple[str, ...], int]] = [
    ({"a": 3, "b": 5, "c": 9, "d": 2, "e": 14}, (), 9),  # 5 rows: bucket 8, widths 4 then 8
    ({}, ("b", "d"), 3),  # 3 rows: bucket 4
    ({"f": 6}, (), 4),  # a step mixing a prefill into the decodes, then 4 rows
    ({"g": 2, "h": 3, "i": 4, "j": 5, "k": 6, "l": 1}, (), 2),  # 10 rows: past every bucket
    ({}, ("a", "c", "e", "f", "g", "h", "i", "j", "k"), 5),  # 1 row
]


@dataclass(slots=True)
class Scenario:
    # Each step's tokens by request.
    steps: list[dict[str, list[int]]] = field(default_factory=list)
    # Steps that a bucket holds: decodes only, at most MAX_BATCH of them.
    graphable: int = 0


def run_scenario(runners: list[ModelRunner], by_handle: bool = False) -> Scenario:
    """Feeds every runner the same plans, asserting each step's tokens agree."""
    maker = PlanMaker(by_handle)
    scenario = Scenario()
    for seed, (new, drop, decodes) in enumerate(SCENARIO):
        plans = [maker.plan({rid: prompt(n, seed * 100 + i) for i, (rid, n) in enumerate(new.items())}, drop)]
        plans += [maker.plan({}) for _ in range(decodes)]
        for plan in plans:
            results = [maker.tokens_of(plan, runner.execute(plan)) for runner in runners]
            assert all(result == results[0] for result in results), f"step {plan.step_id} differs"
            scenario.steps.append(results[0])
            decodes = len(plan.continuing_requests) + len(plan.decode_handles)
            scenario.graphable += not plan.new_requests and decodes <= MAX_BATCH
    return scenario


def test_buckets() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert width_buckets(1) == (1,)
    assert width_buckets(5) == (1, 2, 4, 5)
    assert width_buckets(64) == (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_graphed_decodes_match_the_eager_path(model_dir: Path, device: str) -> None:
    graphed, eager = make_runner(model_dir, device, True), make_runner(model_dir, device, False)
    check_scenario(graphed, eager)


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch != "llama"])
def test_graphed_decodes_match_for_other_attention_shapes(model_dirs: dict[str, Path], arch: str) -> None:
    graphed = make_runner(model_dirs[arch], "cpu", True)
    check_scenario(graphed, make_runner(model_dirs[arch], "cpu", False))


def test_graphed_steady_decodes_by_handle_match_the_eager_path(model_dir: Path) -> None:
    check_scenario(make_runner(model_dir, "cpu", True), make_runner(model_dir, "cpu", False), by_handle=True)


def check_scenario(graphed: ModelRunner, eager: ModelRunner, by_handle: bool = False) -> None:
    scenario = run_scenario([graphed, eager], by_handle)
    assert sum(len(tokens) for tokens in scenario.steps) > 60
    assert graphed.graphs is not None and graphed.graphs.enabled
    # Batches of 5, 3-4 and 1 rows, over contexts of up to 7 blocks; the 10-row steps and those
    # with a prefill ran eagerly.
    assert graphed.graphs.graphed_steps == scenario.graphable == 23
    scratch = graphed.kv_cache.scratch_slot
    for layer in range(graphed.loaded.num_layers):
        for mine, theirs in zip(graphed.kv_cache.layer(layer), eager.kv_cache.layer(layer), strict=True):
            # Padded rows wrote only the scratch slot, which no request reads; every block
            # holds what the eager path wrote.
            assert mine[scratch].abs().sum() > 0 and theirs[scratch].abs().sum() == 0
            torch.testing.assert_close(mine[:scratch], theirs[:scratch], rtol=1e-3, atol=1e-4)


def test_a_bucket_must_fit_the_cache(model_dir: Path) -> None:
    runner = make_runner(model_dir, "cpu", True)
    assert runner.graphs is not None
    runner.execute(PlanMaker().plan({f"r{i}": prompt(33, i) for i in range(5)}))
    work = [ScheduledWork(runner.requests[f"r{i}"], 1) for i in range(5)]
    # Contexts of 34 tokens take 9 blocks, so width 16: 4 rows gather 64 blocks, what the cache
    # holds; 5 rows would be padded to 8 and gather 128.
    assert runner.graphs.bucket(work[:4]) == (4, 16)
    assert runner.graphs.bucket(work) is None


class _FailingRecorder:
    def __init__(self) -> None:
        self.calls = 0

    def capture(self, run: Replay) -> Replay:
        self.calls += 1
        run()
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_turns_graphs_off_and_loses_no_step(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    graphed, eager = make_runner(model_dir, "cpu", False), make_runner(model_dir, "cpu", False)
    recorder = _FailingRecorder()
    attach_graphs(graphed, recorder)
    with caplog.at_level(logging.ERROR, logger=decode_graphs.__name__):
        run_scenario([graphed, eager])
    assert recorder.calls == 1 and not graphed.graphs.enabled and not graphed.graphs.captured
    assert ["event=decode_graphs_off" in r.getMessage() for r in caplog.records] == [True]


class _CountingRecorder(EagerRecorder):
    """Runs the forward at capture, as CUDA's warm-up does, and counts captures."""

    def __init__(self) -> None:
        self.calls = 0

    def capture(self, run: Replay) -> Replay:
        self.calls += 1
        run()
        return run


def test_each_bucket_is_captured_once(model_dir: Path) -> None:
    runner = make_runner(model_dir, "cpu", False)
    recorder = _CountingRecorder()
    graphs = attach_graphs(runner, recorder)
    scenario = run_scenario([runner])
    assert recorder.calls == len(graphs.captured) < scenario.graphable // 2


def test_capturing_every_bucket_up_front_touches_no_block(model_dir: Path) -> None:
    graphed, eager = make_runner(model_dir, "cpu", False), make_runner(model_dir, "cpu", False)
    recorder = _CountingRecorder()
    graphs = attach_graphs(graphed, recorder)
    buckets = graphs.buckets()
    # Every bucket that fits 64 blocks, the largest gather first.
    assert len(buckets) == 22 and buckets[0] == (8, 8) and buckets[-1] == (1, 1)
    assert all(batch * width <= NUM_BLOCKS for batch, width in buckets)
    cache = graphed.kv_cache
    before = [tuple(t.clone() for t in cache.layer(i)) for i in range(graphed.loaded.num_layers)]
    assert graphs.capture_all() == len(buckets) == recorder.calls
    for layer, was in enumerate(before):
        for tensor, old in zip(cache.layer(layer), was, strict=True):
            assert torch.equal(tensor[: cache.scratch_slot], old[: cache.scratch_slot])
            assert not torch.equal(tensor[cache.scratch_slot], old[cache.scratch_slot])
    scenario = run_scenario([graphed, eager])
    assert recorder.calls == len(buckets) and graphs.graphed_steps == scenario.graphable


def test_attention_output_in_any_layout_is_taken_as_it_is(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's memory-efficient SDPA kernel (what a boolean mask gets in float32) returns its
    output transposed in memory; a view of it would raise."""
    real = paged_attention.F.scaled_dot_product_attention

    def transposed_in_memory(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    graphed, eager = make_runner(model_dir, "cpu", True), make_runner(model_dir, "cpu", False)
    monkeypatch.setattr(paged_attention.F, "scaled_dot_product_attention", transposed_in_memory)
    run_scenario([graphed, eager])


def test_the_executor_metrics_count_graphed_steps(model_dir: Path) -> None:
    runner = make_runner(model_dir, "cpu", True)
    metrics = ExecutorMetrics(NUM_BLOCKS, runner.num_kv_blocks_in_use, graphed_steps=runner.graphed_steps)
    maker = PlanMaker(by_handle=True)
    plans = [maker.plan({"a": prompt(5, 1), "b": prompt(9, 2)})] + [maker.plan({}) for _ in range(6)]
    for plan in plans:
        metrics.observe_step(plan, runner.execute(plan))
    assert metrics.registry.get_sample_value("splitserve:executor_graphed_steps_total") == 6
    assert metrics.registry.get_sample_value("splitserve:executor_steps_total") == 7
