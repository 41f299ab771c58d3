"""A hybrid model's request moved between executors with its recurrent state (real processes):
one executor offers the request's blocks and its state slot (KvExport.state_slot), another fetches
both into blocks and a slot of its own (KvImport.state_slot), and the request continues there from
that slot (NewRequest.state_in_slot) with the same tokens and logprobs, bit for bit, as where it
started. Another request's state in its place changes the answer, so the match is the state's
doing; an import that cannot write the state it expects fails and writes nothing; misuse of
state_in_slot is refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from executor_service.recurrent.state_slots import (
    CONV,
    RECURRENT,
    StateKey,
    StateLayout,
    StateSlots,
    StateSpec,
)
from executor_service.recurrent.state_transfer import (
    read_slot,
    state_layout_name,
    write_slot,
)
from executor_service.runner.validation import Limits, check_new
from executor_service.sampling.sampler_settings import SamplerSettings
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.helpers.executor_driver import PlanStream
from tests.helpers.executor_process import start_executor
from tests.helpers.executor_token import with_token
from tests.helpers.hybrid_models import save_hybrid
from tests.helpers.kv_move_driver import MoveSide

BLOCK_SIZE = 8
NUM_BLOCKS = 32
STATE_SLOTS = 6
# Not a whole number of blocks, so the move carries a part-filled block; the two decodes on the
# source and the three after the move fit in the same three blocks.
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(13)]
OTHER_PROMPT = [(11 * i + 5) % 200 + 3 for i in range(13)]
GREEDY = pb.SamplerConfig(want_logprobs=True, num_logprobs=3)
INVALID_ARGUMENT = 3


@dataclass(slots=True)
class Served:
    address: str
    channel: grpc.Channel
    info: pb.ExecutorInfo


def _serve(stack: ExitStack, model_dir: Path) -> Served:
    address, _ = stack.enter_context(
        start_executor(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, state_slots=STATE_SLOTS)
    )
    channel = with_token(stack.enter_context(grpc.insecure_channel(address)))
    return Served(address, channel, pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest()))


# Gated DeltaNet (conv and recurrent state) or short convolution (conv state) layers beside attention.
@pytest.fixture(scope="module", params=["qwen3_next", "lfm2"])
def model_type(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def executors(model_type: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    """Two executors of one tiny hybrid model."""
    model_dir = save_hybrid(model_type, tmp_path_factory.mktemp("hybrid-moves") / model_type)
    with ExitStack() as stack:
        yield _serve(stack, model_dir), _serve(stack, model_dir)


@pytest.fixture
def sides(executors: tuple[Served, Served]) -> Iterator[tuple[MoveSide, MoveSide]]:
    """A fresh plan stream on each executor (which starts it from no requests, offers or imports)."""
    a, b = (MoveSide(served, PlanStream(served.channel, holder="state-moves")) for served in executors)
    yield a, b
    a.stream.close()
    b.stream.close()


def _output(result: pb.StepResult) -> tuple[int, float, list[float]]:
    (output,) = result.outputs
    (record,) = output.logprobs
    return record.token_id, record.logprob, list(record.top_logprobs)


def _run_prompt(a: MoveSide, request_id: str, prompt: list[int], blocks: list[int], slot: int, decodes: int) -> list[int]:
    """Runs a prompt on a, alone in its steps, then `decodes` decodes; the tokens sampled (the
    last one not computed yet)."""
    new = pb.NewRequest(
        request_id=request_id, token_ids=prompt, num_prompt_tokens=len(prompt), block_ids=blocks,
        num_scheduled_tokens=len(prompt), sampling=GREEDY, state_slot=slot,
    )
    sampled = [_output(a.run(new_requests=[new]))[0]]
    for _ in range(decodes):
        decode = pb.ContinuingRequest(request_id=request_id, num_scheduled_tokens=1)
        sampled.append(_output(a.run(continuing_requests=[decode]))[0])
    return sampled


def _moved(request_id: str, sampled: list[int], blocks: list[int], slot: int, **fields: object) -> pb.NewRequest:
    """The request as the destination takes it up: every token but the last sampled computed."""
    return pb.NewRequest(
        request_id=request_id, token_ids=[*PROMPT, *sampled], num_prompt_tokens=len(PROMPT), block_ids=blocks,
        num_computed_tokens=len(PROMPT) + len(sampled) - 1, num_scheduled_tokens=1, sampling=GREEDY,
        state_slot=slot, **fields,
    )


def _continue(side: MoveSide, request_id: str, steps: int, first: pb.NewRequest | None = None) -> list[tuple[int, float, list[float]]]:
    outputs = []
    if first is not None:
        outputs.append(_output(side.run(new_requests=[first])))
    while len(outputs) < steps:
        decode = pb.ContinuingRequest(request_id=request_id, num_scheduled_tokens=1)
        outputs.append(_output(side.run(continuing_requests=[decode])))
    return outputs


def _block_bytes(info: pb.ExecutorInfo) -> int:
    return info.kv_cache_bytes // info.num_kv_blocks


def test_describe_says_a_hybrid_executor_moves_kv_and_names_its_state_layout(executors: tuple[Served, Served]) -> None:
    a, b = (served.info for served in executors)
    assert a.supports_kv_transfer and a.num_state_slots == STATE_SLOTS
    assert a.kv_layout == b.kv_layout
    assert f" state_bytes={a.state_slot_bytes} state=" in a.kv_layout


def test_a_request_moved_with_its_state_continues_bit_for_bit(sides: tuple[MoveSide, MoveSide]) -> None:
    a, b = sides
    # Another request's state, offered with the moved request's blocks: the control.
    _run_prompt(a, "other", OTHER_PROMPT, [3, 4, 5], slot=2, decodes=1)
    sampled = _run_prompt(a, "moved", PROMPT, [0, 1, 2], slot=1, decodes=2)
    a.run(kv_exports=[
        pb.KvExport(transfer_id="good", block_ids=[0, 1, 2], state_slot=1),
        pb.KvExport(transfer_id="wrong", block_ids=[0, 1, 2], state_slot=2),
        pb.KvExport(transfer_id="plain", block_ids=[0, 1, 2], state_slot=1),
    ])
    b.run(kv_imports=[
        pb.KvImport(transfer_id="good", source_address=a.served.address, block_ids=[10, 11, 12], state_slot=3),
        pb.KvImport(transfer_id="wrong", source_address=a.served.address, block_ids=[20, 21, 22], state_slot=4),
        # The blocks alone: the scheduler did not ask for the state.
        pb.KvImport(transfer_id="plain", source_address=a.served.address, block_ids=[5, 6, 7]),
    ])
    done = b.wait_imports({"good", "wrong", "plain"})
    assert all(result.ok for result in done.values()), done
    assert done["wrong"].bytes == 3 * _block_bytes(a.served.info) + a.served.info.state_slot_bytes
    # A slot the blocks-only import left alone holds no state to take up.
    refused = b.step(new_requests=[_moved("blind", sampled, [5, 6, 7], slot=5, state_in_slot=True)])
    assert [(r.request_id, r.code) for r in refused.rejected] == [("blind", INVALID_ARGUMENT)]
    assert "holds no state an import wrote" in refused.rejected[0].message

    there = _continue(b, "moved", 3, _moved("moved", sampled, [10, 11, 12], slot=3, state_in_slot=True))
    here = _continue(a, "moved", 3)
    assert there == here
    # The same blocks with another request's state: another answer.
    wrong = _output(b.run(new_requests=[_moved("wrong", sampled, [20, 21, 22], slot=4, state_in_slot=True)]))
    assert wrong[1:] != there[0][1:]


def test_an_offer_with_no_block_left_to_send_still_sends_its_state(sides: tuple[MoveSide, MoveSide]) -> None:
    a, b = sides
    _run_prompt(a, "moved", PROMPT, [0, 1], slot=1, decodes=0)
    a.run(kv_exports=[pb.KvExport(transfer_id="state-only", block_ids=[0, 1], state_slot=1)])
    stub = pb_grpc.KvTransferStub(a.served.channel)
    whole = list(stub.FetchBlocks(pb.FetchBlocksRequest(transfer_id="state-only"), timeout=10))
    assert [(c.first_block, c.num_blocks, len(c.state)) for c in whole] == [(0, 2, 0), (2, 0, a.served.info.state_slot_bytes)]
    (last,) = stub.FetchBlocks(pb.FetchBlocksRequest(transfer_id="state-only", first_block=2), timeout=10)
    assert (last.num_blocks, last.data, last.state) == (0, b"", whole[-1].state)
    assert last.kv_layout == a.served.info.kv_layout
    # b holds both blocks already (a prefix hit): it fetches the state alone.
    b.run(kv_imports=[pb.KvImport(transfer_id="state-only", source_address=a.served.address, first_block=2, state_slot=2)])
    done = b.wait_imports({"state-only"})["state-only"]
    assert done.ok, done.error
    assert done.bytes == a.served.info.state_slot_bytes


def test_an_import_that_cannot_write_the_state_it_expects_fails_and_writes_nothing(sides: tuple[MoveSide, MoveSide]) -> None:
    a, b = sides
    sampled = _run_prompt(a, "moved", PROMPT, [0, 1, 2], slot=1, decodes=1)
    a.run(kv_exports=[pb.KvExport(transfer_id="blocks-only", block_ids=[0, 1, 2])])
    # A request on b holds slot 2.
    holder = pb.NewRequest(request_id="holder", token_ids=OTHER_PROMPT, block_ids=[30, 31], num_scheduled_tokens=8, state_slot=2)
    b.run(new_requests=[holder])
    b.run(kv_imports=[
        pb.KvImport(transfer_id="blocks-only", source_address=a.served.address, block_ids=[10, 11, 12], state_slot=3),
    ])
    assert not b.wait_imports({"blocks-only"})["blocks-only"].ok
    a.run(kv_exports=[pb.KvExport(transfer_id="with-state", block_ids=[0, 1, 2], state_slot=1)])
    b.run(kv_imports=[
        pb.KvImport(transfer_id="with-state", source_address=a.served.address, block_ids=[20, 21, 22], state_slot=2),
    ])
    held = b.wait_imports({"with-state"})["with-state"]
    failed = next(done for done in b.imports_done if done.transfer_id == "blocks-only")
    assert "carried no recurrent state" in failed.error
    assert not held.ok and "held by request 'holder'" in held.error
    # Neither slot took the state: a request that would start from it is refused.
    for slot in (3, 2):
        refused = b.step(new_requests=[_moved(f"from-{slot}", sampled, [13, 14, 15], slot=slot, state_in_slot=True)])
        assert [r.code for r in refused.rejected] == [INVALID_ARGUMENT], slot
    # The holder's own state was left alone: it decodes on.
    assert b.run(continuing_requests=[pb.ContinuingRequest(request_id="holder", num_scheduled_tokens=5)]).outputs


# A convolution window of another width: the same attention layers, another state.
OTHER_CONV_WIDTH = {"qwen3_next": {"linear_conv_kernel_dim": 3}, "lfm2": {"conv_L_cache": 4}}


def test_an_import_of_another_state_layout_fails(sides: tuple[MoveSide, MoveSide], model_type: str, tmp_path: Path) -> None:
    _, b = sides
    other_dir = save_hybrid(model_type, tmp_path / "other", **OTHER_CONV_WIDTH[model_type])
    with ExitStack() as stack:
        other = _serve(stack, other_dir)
        assert other.info.kv_layout.split(" state_bytes=")[0] == b.served.info.kv_layout.split(" state_bytes=")[0]
        assert other.info.kv_layout != b.served.info.kv_layout
        source = MoveSide(other, PlanStream(other.channel, holder="state-moves"))
        new = pb.NewRequest(request_id="r", token_ids=PROMPT, block_ids=[0, 1], num_scheduled_tokens=len(PROMPT), state_slot=1)
        source.run(new_requests=[new], kv_exports=[pb.KvExport(transfer_id="other-layout", block_ids=[0, 1], state_slot=1)])
        b.run(kv_imports=[pb.KvImport(transfer_id="other-layout", source_address=other.address, block_ids=[10, 11], state_slot=3)])
        failed = b.wait_imports({"other-layout"})["other-layout"]
        source.stream.close()
    assert not failed.ok
    assert "kv_layout" in failed.error and "state=" in failed.error


@pytest.mark.parametrize(
    ("fields", "num_state_slots", "problem"),
    [
        ({"state_slot": 2, "num_computed_tokens": 8, "state_in_slot": True, "state_source_slot": 3}, 4, "both set"),
        ({"state_slot": 2, "state_in_slot": True}, 4, "computes from its first token"),
        ({"num_computed_tokens": 8, "state_in_slot": True}, 0, "no recurrent layers"),
        ({"state_slot": 2, "num_computed_tokens": 8}, 4, "without a state_source_slot"),
    ],
)
def test_state_in_slot_misuse_is_refused(fields: dict[str, object], num_state_slots: int, problem: str) -> None:
    entry = pb.NewRequest(request_id="r", token_ids=list(range(16)), block_ids=[0, 1], num_scheduled_tokens=8, **fields)
    limits = Limits(vocab_size=1000, num_kv_blocks=8, block_size=8, max_model_len=64, max_logprobs=5, num_state_slots=num_state_slots)
    assert problem in (check_new(entry, SamplerSettings.from_proto(entry.sampling), limits) or "")


def test_state_in_slot_with_computed_tokens_is_valid() -> None:
    entry = pb.NewRequest(
        request_id="r", token_ids=list(range(16)), block_ids=[0, 1], num_computed_tokens=8, num_scheduled_tokens=8,
        state_slot=2, state_in_slot=True,
    )
    limits = Limits(vocab_size=1000, num_kv_blocks=8, block_size=8, max_model_len=64, max_logprobs=5, num_state_slots=4)
    assert check_new(entry, SamplerSettings.from_proto(entry.sampling), limits) is None


def _layout(conv_dtype: torch.dtype) -> StateLayout:
    return StateLayout({
        StateKey(2, RECURRENT, 0): StateSpec((2, 3), torch.float32),
        StateKey(0, CONV, 0): StateSpec((3,), conv_dtype),
        StateKey(0, RECURRENT, 0): StateSpec((5,), torch.float32),
    })


def test_a_slot_goes_to_bytes_and_back_in_every_dtype_and_a_wrong_size_writes_nothing() -> None:
    states = StateSlots(_layout(torch.bfloat16), 3, torch.device("cpu"))
    for tensor in states.tensors.values():
        tensor.normal_()
    data = read_slot(states, 2)
    assert len(data) == states.layout.bytes_per_slot() == 2 * 3 * 4 + 3 * 2 + 5 * 4
    write_slot(states, 1, data)
    assert all(torch.equal(tensor[1], tensor[2]) for tensor in states.tensors.values())
    before = {key: tensor.clone() for key, tensor in states.tensors.items()}
    with pytest.raises(ValueError, match="not one slot's"):
        write_slot(states, 3, data[:-2])
    assert all(torch.equal(before[key], tensor) for key, tensor in states.tensors.items())


def test_the_state_layout_name_says_sizes_and_changes_with_any_dtype_or_shape() -> None:
    name = state_layout_name(_layout(torch.bfloat16))
    assert name.startswith("state_bytes=50 state=")
    assert name != state_layout_name(_layout(torch.float16))
    assert name == state_layout_name(StateLayout(dict(reversed(_layout(torch.bfloat16).specs.items()))))
