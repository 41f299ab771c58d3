"""The host tier of K/V blocks (--kv-host-gib): a plan's swap-outs copy device blocks into host
blocks and its swap-ins copy them back, before the step, swap-outs first. A request swapped out,
dropped, its device blocks overwritten by another request, then swapped back into other device
blocks continues with the same tokens and logprobs, bit for bit, as it would have without the
swap. Bad swap entries refuse only the new requests that read them."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from executor_service.__main__ import parse_args
from executor_service.attention.host_tier import HostBlocks
from executor_service.attention.kv_cache import KVCacheShape, PagedKVCache
from executor_service.runner.block_swaps import run_swaps
from executor_service.runner.validation import Limits
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.helpers.executor_driver import PlanStream
from tests.helpers.executor_process import executor_command, start_executor
from tests.helpers.executor_token import with_token
from tests.helpers.hybrid_models import save_hybrid
from tests.helpers.metrics_scrape import scrape
from tests.helpers.model_factory import build_model
from tests.helpers.service_process import REPO_ROOT, free_port

BLOCK_SIZE = 8
NUM_BLOCKS = 32
HOST_GIB = 0.01
# 2 layers of 2 K/V heads, key and value dims of 16, float32.
BYTES_PER_BLOCK = 2 * BLOCK_SIZE * 2 * (16 + 16) * 4
NUM_HOST_BLOCKS = int(HOST_GIB * (1 << 30)) // BYTES_PER_BLOCK
# Host blocks at or past this one are never filled: the refusal tests name them.
NEVER_FILLED = 1000
INTERNAL = 13
# Two full blocks and half of a third; the decodes go on into a fourth.
PROMPT_A = [(7 * i + 3) % 1000 + 3 for i in range(20)]
PROMPT_B = [(11 * i + 5) % 1000 + 3 for i in range(24)]
GREEDY = pb.SamplerConfig(want_logprobs=True, num_logprobs=3)
DECODES_BEFORE = 2
DECODES_AFTER = 5

Output = tuple[int, float, list[int], list[float]]
# On CUDA the tier is pinned and its copies asynchronous.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"))]
_ids = itertools.count()


# --- HostBlocks and run_swaps, in process ---------------------------------------------------


def _cache(dtype: torch.dtype, device: str = "cpu") -> PagedKVCache:
    shape = KVCacheShape(num_layers=2, num_kv_heads=2, key_dim=16, value_dim=8, block_size=4, dtype=dtype)
    cache = PagedKVCache(shape, 8, torch.device(device))
    for tensor in (*cache.keys, *cache.values):
        tensor.copy_(torch.randn(tensor.shape))
    return cache


def _overwrite(cache: PagedKVCache, block_ids: list[int]) -> None:
    slots = [b * cache.block_size + i for b in block_ids for i in range(cache.block_size)]
    for tensor in (*cache.keys, *cache.values):
        tensor[slots] = torch.randn(len(slots), *tensor.shape[1:]).to(tensor.dtype).to(tensor.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_swapped_out_and_back_into_other_blocks_keep_their_bytes(dtype: torch.dtype, device: str) -> None:
    cache = _cache(dtype, device)
    host = HostBlocks(cache, num_blocks=4)
    assert host.keys[0].is_pinned() == (device == "cuda")
    before = [cache.read_blocks([block]) for block in (3, 5)]
    host.swap_out([3, 5], [1, 0])
    _overwrite(cache, [3, 5])
    assert cache.read_blocks([3]) != before[0]
    host.swap_in([1, 0], [6, 2])
    assert [cache.read_blocks([6]), cache.read_blocks([2])] == before
    assert host.swapped == [2, 2]


def test_a_target_named_twice_holds_its_last_copy() -> None:
    cache = _cache(torch.float32)
    host = HostBlocks(cache, num_blocks=2)
    second = cache.read_blocks([2])
    host.swap_out([1, 2], [0, 0])
    host.swap_in([1, 0], [4, 4])
    assert cache.read_blocks([4]) == second


def _limits(num_host_blocks: int) -> Limits:
    return Limits(
        vocab_size=100, num_kv_blocks=8, block_size=4, max_model_len=32, max_logprobs=5, num_host_blocks=num_host_blocks
    )


def test_swaps_without_a_tier_are_refused_and_the_blocks_they_fill_named() -> None:
    plan = pb.StepPlan(step_id=1, swap_in_host_blocks=[0], swap_in_device_blocks=[3])
    unfilled = run_swaps(plan, None, _limits(0))
    assert list(unfilled) == [3] and "no host tier (--kv-host-gib)" in unfilled[3]


def test_a_refused_swap_out_leaves_its_host_blocks_unreadable() -> None:
    cache = _cache(torch.float32)
    host = HostBlocks(cache, num_blocks=4)
    limits = _limits(4)
    assert run_swaps(pb.StepPlan(step_id=1, swap_out_device_blocks=[5], swap_out_host_blocks=[2]), host, limits) == {}
    refused = pb.StepPlan(step_id=2, swap_out_device_blocks=[5, 6], swap_out_host_blocks=[2])
    assert run_swaps(refused, host, limits) == {}
    unfilled = run_swaps(pb.StepPlan(step_id=3, swap_in_host_blocks=[2], swap_in_device_blocks=[7]), host, limits)
    assert "host block 2 holds nothing a swap-out put there" in unfilled[7]
    # The same plan's swap-outs run first, so its swap-ins may read what they fill.
    both = pb.StepPlan(step_id=4, swap_out_device_blocks=[5], swap_out_host_blocks=[2], swap_in_host_blocks=[2], swap_in_device_blocks=[7])
    assert run_swaps(both, host, limits) == {}
    assert cache.read_blocks([7]) == cache.read_blocks([5])
    host.forget_all()
    assert host.unfilled([2], filled_first=[]) == 2


# --- the command line ----------------------------------------------------------------------

MODEL = ["--model", "/m", "--insecure-executor"]


def test_the_flag_parses_and_no_tier_is_the_default() -> None:
    assert parse_args(MODEL).kv_host_gib == 0
    assert parse_args([*MODEL, "--kv-host-gib", "0.5"]).kv_host_gib == 0.5


@pytest.mark.parametrize("flags", [["--kv-host-gib", "-1"], ["--kv-host-gib", "lots"], ["--kv-host-gib", "1", "--tensor-parallel-size", "2"]])
def test_a_tier_that_cannot_be_had_is_argparses_error(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*MODEL, *flags])
    assert exit_.value.code == 2
    assert "--kv-host-gib" in capsys.readouterr().err.splitlines()[-1]


def test_a_hybrid_model_with_a_host_tier_is_refused_with_why(tmp_path: Path) -> None:
    model_dir = save_hybrid("lfm2", tmp_path / "lfm2")
    run = subprocess.run(
        executor_command(model_dir, kv_host_gib=HOST_GIB, max_model_len=256),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 1, log
    refusals = [line for line in log.splitlines() if "event=executor_refused" in line]
    assert len(refusals) == 1 and "model_type=lfm2 " in refusals[0], log
    assert "the host tier keeps K/V blocks, not recurrent state" in refusals[0]
    assert "Traceback" not in log and "event=executor_ready" not in log


# --- a real executor -----------------------------------------------------------------------


@dataclass(slots=True)
class Served:
    channel: grpc.Channel
    metrics_port: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = build_model("llama", tmp_path_factory.mktemp("host-tier") / "llama", seed=5)
    metrics_port = free_port()
    flags = {"num_kv_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "kv_host_gib": HOST_GIB, "metrics_port": metrics_port}
    with start_executor(model_dir, **flags) as (address, _):
        with grpc.insecure_channel(address) as channel:
            yield Served(with_token(channel), metrics_port)


@dataclass
class Side:
    stream: PlanStream

    def step(self, **fields: object) -> pb.StepResult:
        return self.stream.plan(**fields)

    def run(self, **fields: object) -> dict[str, Output]:
        """A step that must refuse nothing: each request's output."""
        result = self.step(**fields)
        assert not result.rejected, result.rejected
        return {output.request_id: _output(output) for output in result.outputs}


@pytest.fixture
def side(served: Served) -> Iterator[Side]:
    side = Side(PlanStream(served.channel, holder="host-tier-test"))
    yield side
    side.stream.close()


def _output(output: pb.RequestOutput) -> Output:
    (record,) = output.logprobs
    return record.token_id, record.logprob, list(record.top_token_ids), list(record.top_logprobs)


def _new(request_id: str, tokens: list[int], num_prompt: int, blocks: list[int], computed: int = 0) -> pb.NewRequest:
    return pb.NewRequest(
        request_id=request_id, token_ids=tokens, num_prompt_tokens=num_prompt, block_ids=blocks,
        num_computed_tokens=computed, num_scheduled_tokens=len(tokens) - computed, sampling=GREEDY,
    )


def _decode(request_id: str) -> pb.ContinuingRequest:
    return pb.ContinuingRequest(request_id=request_id, num_scheduled_tokens=1)


def _prefill(side: Side, request_id: str, prompt: list[int], blocks: list[int], decodes: int) -> list[Output]:
    """The prompt, then `decodes` decode steps: the outputs (the last token not computed yet)."""
    outputs = [side.run(new_requests=[_new(request_id, prompt, len(prompt), blocks)])[request_id]]
    for _ in range(decodes):
        outputs.append(side.run(continuing_requests=[_decode(request_id)])[request_id])
    return outputs


def _resume(side: Side, request_id: str, prompt: list[int], before: list[Output], blocks: list[int], **swaps: object) -> list[Output]:
    """The request back as a NewRequest whose computed tokens' K/V are in the leading `blocks`
    (filled by the plan's swaps), then decodes: its next DECODES_AFTER outputs."""
    tokens = [*prompt, *(token for token, *_ in before)]
    first = _new(request_id, tokens, len(prompt), blocks, computed=len(tokens) - 1)
    outputs = [side.run(new_requests=[first], **swaps)[request_id]]
    while len(outputs) < DECODES_AFTER:
        outputs.append(side.run(continuing_requests=[_decode(request_id)])[request_id])
    side.run(dropped_request_ids=[request_id])
    return outputs


def _reference(side: Side, prompt: list[int], blocks: list[int]) -> list[Output]:
    """A request's outputs run without interruption."""
    request_id = f"reference{next(_ids)}"
    outputs = _prefill(side, request_id, prompt, blocks, DECODES_BEFORE + DECODES_AFTER)
    side.run(dropped_request_ids=[request_id])
    return outputs


def test_the_tier_is_described(served: Served) -> None:
    info = pb_grpc.ExecutorStub(served.channel).Describe(pb.DescribeRequest())
    assert info.num_host_blocks == NUM_HOST_BLOCKS


def test_a_request_swapped_out_and_back_into_other_blocks_continues_bit_for_bit(served: Served, side: Side) -> None:
    reference = _reference(side, PROMPT_A, [20, 21, 22, 23])
    samples, _ = scrape(served.metrics_port)
    swapped = {d: samples[f'splitserve:executor_kv_swapped_blocks_total{{direction="{d}"}}'] for d in ("out", "in")}
    before = _prefill(side, "a", PROMPT_A, [0, 1, 2], DECODES_BEFORE)
    assert before == reference[: DECODES_BEFORE + 1]
    # Preempted by swapping: its blocks go to the host, then another request overwrites them.
    side.run(dropped_request_ids=["a"], swap_out_device_blocks=[0, 1, 2], swap_out_host_blocks=[5, 6, 7])
    _prefill(side, "b", PROMPT_B, [0, 1, 2], 0)
    after = _resume(side, "a", PROMPT_A, before, [10, 12, 11, 13], swap_in_host_blocks=[5, 7, 6], swap_in_device_blocks=[10, 11, 12])
    assert before + after == reference
    samples, _ = scrape(served.metrics_port)
    assert samples["splitserve:executor_kv_host_blocks_total"] == NUM_HOST_BLOCKS
    assert samples['splitserve:executor_kv_swapped_blocks_total{direction="out"}'] == swapped["out"] + 3
    assert samples['splitserve:executor_kv_swapped_blocks_total{direction="in"}'] == swapped["in"] + 3


def test_without_the_swap_in_the_continuation_differs(side: Side) -> None:
    """The control: blocks that hold another request's K/V give other logprobs."""
    reference = _reference(side, PROMPT_A, [20, 21, 22, 23])
    before = _prefill(side, "a", PROMPT_A, [0, 1, 2], DECODES_BEFORE)
    side.run(dropped_request_ids=["a"], swap_out_device_blocks=[0, 1, 2], swap_out_host_blocks=[5, 6, 7])
    _prefill(side, "b", PROMPT_B, [0, 1, 2], 0)
    after = _resume(side, "a", PROMPT_A, before, [0, 1, 2, 3])
    assert before + after != reference


def test_a_plans_swap_outs_run_before_its_swap_ins(side: Side) -> None:
    """One plan swaps b out of the blocks a is swapped back into: both continue bit for bit."""
    references = {"a": _reference(side, PROMPT_A, [20, 21, 22, 23]), "b": _reference(side, PROMPT_B, [24, 25, 26, 27])}
    before = {"a": _prefill(side, "a", PROMPT_A, [0, 1, 2], DECODES_BEFORE)}
    side.run(dropped_request_ids=["a"], swap_out_device_blocks=[0, 1, 2], swap_out_host_blocks=[5, 6, 7])
    before["b"] = _prefill(side, "b", PROMPT_B, [2, 0, 1, 3], DECODES_BEFORE)
    side.run(dropped_request_ids=["b"])
    swaps = {
        "swap_out_device_blocks": [2, 0, 1, 3], "swap_out_host_blocks": [8, 9, 10, 11],
        "swap_in_host_blocks": [5, 6, 7], "swap_in_device_blocks": [0, 1, 2],
    }
    after_a = _resume(side, "a", PROMPT_A, before["a"], [0, 1, 2, 3], **swaps)
    after_b = _resume(
        side, "b", PROMPT_B, before["b"], [12, 13, 14, 15], swap_in_host_blocks=[8, 9, 10, 11], swap_in_device_blocks=[12, 13, 14, 15]
    )
    assert before["a"] + after_a == references["a"]
    assert before["b"] + after_b == references["b"]


BAD_SWAPS = {
    "lengths-differ": ({"swap_out_device_blocks": [3, 4], "swap_out_host_blocks": [NEVER_FILLED]}, "differ in length"),
    "outside-the-pool": ({"swap_in_host_blocks": [NEVER_FILLED, NEVER_FILLED + 1], "swap_in_device_blocks": [30, NUM_BLOCKS]}, "outside the pool"),
    "outside-the-tier": ({"swap_out_device_blocks": [3], "swap_out_host_blocks": [NUM_HOST_BLOCKS]}, "outside the host tier"),
    "never-filled": ({}, f"host block {NEVER_FILLED} holds nothing a swap-out put there"),
}


@pytest.mark.parametrize("case", BAD_SWAPS)
def test_bad_swaps_refuse_only_the_new_request_reading_them(side: Side, case: str) -> None:
    """A scheduler's bug (INTERNAL): the request whose table holds a swap-in's destination is
    refused; the plan's other new request runs as it would have."""
    swaps, problem = BAD_SWAPS[case]
    swaps = {"swap_in_host_blocks": [NEVER_FILLED], "swap_in_device_blocks": [30], **swaps}
    reference = _reference(side, PROMPT_B, [20, 21, 22, 23])
    reader = _new("reader", PROMPT_A, len(PROMPT_A), [30, 29, 28], computed=len(PROMPT_A) - 1)
    result = side.step(new_requests=[_new("good", PROMPT_B, len(PROMPT_B), [0, 1, 2, 3]), reader], **swaps)
    assert [(r.request_id, r.code) for r in result.rejected] == [("reader", INTERNAL)]
    assert problem in result.rejected[0].message
    assert [_output(o) for o in result.outputs] == reference[:1]
    side.run(dropped_request_ids=["good"])
