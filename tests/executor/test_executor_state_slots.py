"""Recurrent-state slots on a ModelRunner in this process, over a random Qwen3-Next (Gated
DeltaNet layers beside attention): a request's state lives in the slot its NewRequest names, a
checkpoint keeps it at a point inside a chunk, and a request that resumes from that checkpoint
over the shared prefix's blocks samples what a request computing its whole prompt samples. Plans
that name slots wrongly are refused with a message saying what is wrong."""

from __future__ import annotations

import pytest
import torch
from transformers import Cache
from transformers.cache_utils import LinearAttentionLayer

from executor_service.recurrent.recurrent_step import SequenceWork, build_recurrent_step
from executor_service.recurrent.slot_cache import SlotStates
from executor_service.recurrent.state_slots import (
    CONV,
    StateKey,
    StateLayout,
    StateSlots,
    StateSpec,
)
from executor_service.runner.model_runner import ModelRunner
from executor_service.serving.metrics import ExecutorMetrics
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import ReadyExecutor, build_executor
from protos import rpc_codes
from protos.splitserve.executor.v1 import executor_pb2 as pb
from tests.helpers.hybrid_models import save_hybrid

BLOCK_SIZE = 16
SHARED = [(7 * i) % 900 + 5 for i in range(64)]
TAIL = [(11 * i) % 900 + 5 for i in range(30)]
GREEDY_WITH_LOGPROBS = pb.SamplerConfig(temperature=0, want_logprobs=True)


@pytest.fixture(scope="module")
def ready(tmp_path_factory: pytest.TempPathFactory) -> ReadyExecutor:
    torch.set_num_threads(1)
    folder = save_hybrid("qwen3_next", tmp_path_factory.mktemp("hybrid") / "qwen3_next")
    settings = ExecutorSettings(
        model_dir=folder, device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE, state_slots=8, max_model_len=1024
    )
    return build_executor(settings)


@pytest.fixture()
def runner(ready: ReadyExecutor) -> ModelRunner:
    ready.runner.drop_all_requests(wipe_kv=True)
    return ready.runner


def _new(request_id: str, tokens: list[int], blocks: list[int], slot: int, **fields: int) -> pb.NewRequest:
    computed = fields.pop("num_computed_tokens", 0)
    return pb.NewRequest(
        request_id=request_id,
        token_ids=tokens,
        block_ids=blocks,
        num_computed_tokens=computed,
        num_scheduled_tokens=len(tokens) - computed,
        sampling=GREEDY_WITH_LOGPROBS,
        state_slot=slot,
        **fields,
    )


def test_describe_reports_the_slots_no_block_copies_and_kv_transfer_with_the_state(ready: ReadyExecutor) -> None:
    info = ready.info
    assert info.num_state_slots == 8
    assert info.state_slot_bytes == ready.runner.loaded.recurrent.layout.bytes_per_slot() > 0
    assert info.supports_state_checkpoints and not info.supports_block_copies
    # A rejected draft's positions would stay in the recurrent state.
    assert not info.supports_draft_tokens
    # Recurrent state travels with the blocks, so kv_layout names its layout too.
    assert info.supports_kv_transfer
    assert info.kv_layout.endswith(f" state_bytes={info.state_slot_bytes} state={info.kv_layout[-16:]}")


def test_a_request_resumed_from_a_checkpoint_samples_what_a_whole_prompt_does(runner: ModelRunner) -> None:
    # "source" computes the shared 64 tokens and more in one chunk, keeping its state at 64.
    source = _new("source", SHARED + [901, 902, 903], [0, 1, 2, 3, 4], slot=1)
    plan = pb.StepPlan(step_id=1, new_requests=[source])
    plan.state_checkpoints.add(request_id="source", num_tokens=64, slot=5)
    assert not runner.execute(plan).rejected
    assert 5 in runner.checkpointed
    # "resumed" shares the first four blocks and starts from the checkpoint; "whole" computes all.
    resumed = _new("resumed", SHARED + TAIL, [0, 1, 2, 3, 10, 11], slot=2, num_computed_tokens=64, state_source_slot=5)
    whole = _new("whole", SHARED + TAIL, [20, 21, 22, 23, 24, 25], slot=3)
    result = runner.execute(pb.StepPlan(step_id=2, new_requests=[resumed, whole]))
    assert not result.rejected
    got, expected = result.outputs
    assert list(got.token_ids) == list(expected.token_ids)
    assert got.logprobs[0].logprob == pytest.approx(expected.logprobs[0].logprob, abs=1e-4)
    # Decodes from both states stay together.
    for step in range(3, 5):
        plan = pb.StepPlan(step_id=step)
        plan.continuing_requests.add(request_id="resumed", num_scheduled_tokens=1)
        plan.continuing_requests.add(request_id="whole", num_scheduled_tokens=1)
        got, expected = runner.execute(plan).outputs
        assert list(got.token_ids) == list(expected.token_ids)


def test_a_resumed_request_differs_without_its_checkpoint(runner: ModelRunner) -> None:
    """The copy matters: resuming from another request's checkpoint gives other logits."""
    other = _new("other", TAIL + SHARED, [0, 1, 2, 3, 4, 5], slot=1)
    plan = pb.StepPlan(step_id=1, new_requests=[other])
    plan.state_checkpoints.add(request_id="other", num_tokens=64, slot=6)
    runner.execute(plan)
    resumed = _new("wrong", SHARED + TAIL, [20, 21, 22, 23, 10, 11], slot=2, num_computed_tokens=64, state_source_slot=6)
    whole = _new("whole", SHARED + TAIL, [30, 31, 32, 33, 34, 35], slot=3)
    got, expected = runner.execute(pb.StepPlan(step_id=2, new_requests=[resumed, whole])).outputs
    assert got.logprobs[0].logprob != pytest.approx(expected.logprobs[0].logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"slot": 0}, "state_slot 0 outside [1, 8]"),
        ({"slot": 9}, "state_slot 9 outside [1, 8]"),
        ({"slot": 2, "num_computed_tokens": 16}, "without a state_source_slot"),
        ({"slot": 2, "num_computed_tokens": 16, "state_source_slot": 7}, "holds no checkpoint"),
        ({"slot": 2, "state_source_slot": 7}, "computes from its first token"),
        ({"slot": 1}, "is held by request 'holder'"),
    ],
)
def test_a_request_naming_slots_wrongly_is_refused(runner: ModelRunner, fields: dict[str, int], problem: str) -> None:
    runner.execute(pb.StepPlan(step_id=1, new_requests=[_new("holder", SHARED[:5], [0], slot=1)]))
    slot = fields.pop("slot")
    result = runner.execute(pb.StepPlan(step_id=2, new_requests=[_new("bad", SHARED[:20], [1, 2], slot, **fields)]))
    assert [r.request_id for r in result.rejected] == ["bad"]
    assert result.rejected[0].code == rpc_codes.INVALID_ARGUMENT and problem in result.rejected[0].message
    assert "holder" in runner.requests and "bad" not in runner.requests


def test_a_checkpoint_that_cannot_be_made_is_not_resumed_from(runner: ModelRunner) -> None:
    plan = pb.StepPlan(step_id=1, new_requests=[_new("a", SHARED, [0, 1, 2, 3], slot=1)])
    # Past what the request computes, and into the request's own slot: neither is made.
    plan.state_checkpoints.add(request_id="a", num_tokens=65, slot=4)
    plan.state_checkpoints.add(request_id="a", num_tokens=32, slot=1)
    assert not runner.execute(plan).rejected
    assert runner.checkpointed == set()


def test_the_split_cuts_chunks_at_checkpoints_and_batches_decodes() -> None:
    step = build_recurrent_step(
        [
            SequenceWork(token_start=0, num_new=1, num_cached=9, slot=4, checkpoints=((1, 7),)),
            SequenceWork(token_start=1, num_new=10, num_cached=0, slot=2, checkpoints=((4, 5), (10, 6))),
            SequenceWork(token_start=11, num_new=1, num_cached=3, slot=3),
        ],
        device=torch.device("cpu"),
    )
    decodes, first, second = step.calls
    assert decodes.token_index.tolist() == [0, 11] and decodes.slots.tolist() == [4, 3] and decodes.keep == ((4, 7),)
    assert (first.token_index.tolist(), first.continuing, first.keep) == ([1, 2, 3, 4], False, ((2, 5),))
    assert (second.token_index.tolist(), second.continuing, second.keep) == (list(range(5, 11)), True, ((2, 6),))
    ones = second.one_token_calls()
    assert [c.keep for c in ones] == [()] * 5 + [((2, 6),)] and all(c.continuing for c in ones)


@pytest.mark.parametrize("lengths", [(2,), (6,), (3, 1), (5, 2, 1)])
def test_slot_states_keep_the_conv_window_as_transformers_cache_does(lengths: tuple[int, ...]) -> None:
    """SlotStates answers update_conv_state as transformers' linear-attention cache layer does,
    from a sequence's first chunk on, whatever the chunk lengths."""
    width, channels = 4, 3
    key = StateKey(0, CONV, 0)
    slots = StateSlots(StateLayout({key: StateSpec((channels, width), torch.float32)}), 2, torch.device("cpu"))
    theirs = Cache(layers=[LinearAttentionLayer()])
    generator = torch.Generator().manual_seed(len(lengths))
    for i, length in enumerate(lengths):
        chunk = torch.randn(1, channels, length, generator=generator)
        ours = SlotStates(slots, torch.tensor([2]), continuing=i > 0)
        got = ours.update_conv_state(chunk, 0, conv_kernel_size=width)
        ours.commit()
        expected = theirs.update_conv_state(chunk, 0, conv_kernel_size=width)
        assert torch.equal(got, expected)
        assert torch.equal(slots.tensors[key][2], theirs.layers[0].conv_states[0][0])


def test_metrics_count_the_slots_held_by_requests_and_checkpoints(ready: ReadyExecutor, runner: ModelRunner) -> None:
    metrics = ExecutorMetrics(
        ready.info.num_kv_blocks,
        runner.num_kv_blocks_in_use,
        num_state_slots=ready.info.num_state_slots,
        slots_in_use=runner.state_slots_in_use,
    )
    plan = pb.StepPlan(step_id=1, new_requests=[_new("a", SHARED, [0, 1, 2, 3], slot=1), _new("b", TAIL, [4, 5], slot=2)])
    plan.state_checkpoints.add(request_id="a", num_tokens=32, slot=7)
    metrics.observe_step(plan, runner.execute(plan))
    value = metrics.registry.get_sample_value
    assert value("splitserve:executor_state_slots_total") == 8
    assert value("splitserve:executor_state_slots_in_use", {"holder": "request"}) == 2
    assert value("splitserve:executor_state_slots_in_use", {"holder": "checkpoint"}) == 1
