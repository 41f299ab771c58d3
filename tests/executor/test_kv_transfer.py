"""K/V that moves between executors (real processes): one executor offers a request's blocks
(StepPlan.kv_exports), another fetches them into blocks of its own (kv_imports) while it goes on
stepping, and the request continues there with the same tokens and logprobs, bit for bit, as it
would have where it started. Failed, cancelled and refused moves disturb nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from protos.executor_access import EXECUTOR_TOKEN_METADATA
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.helpers.executor_driver import PlanStream
from tests.helpers.executor_process import start_executor
from tests.helpers.executor_token import token, with_token
from tests.helpers.kv_move_driver import MoveSide
from tests.helpers.metrics_scrape import scrape
from tests.helpers.model_factory import build_model
from tests.helpers.service_process import free_port

BLOCK_SIZE = 8
NUM_BLOCKS = 32
LAYOUT = f"float32 layers=2 kv_heads=2 key_dim=16 value_dim=16 block_size={BLOCK_SIZE}"
# Two full blocks; the decodes fill the third.
PROMPT = [(7 * i + 3) % 1000 + 3 for i in range(2 * BLOCK_SIZE)]
GREEDY = pb.SamplerConfig(want_logprobs=True, num_logprobs=3)


@dataclass(slots=True)
class Served:
    address: str
    channel: grpc.Channel
    metrics_port: int


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("kv-transfer") / "llama", seed=5)


@pytest.fixture(scope="module")
def executors(model_dir: Path) -> Iterator[tuple[Served, Served]]:
    """Two executors of the same model: the first with --role prefill, the second default."""
    with ExitStack() as stack:
        served = []
        for flags in ({"role": "prefill"}, {}):
            metrics_port = free_port()
            address, _ = stack.enter_context(
                start_executor(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, metrics_port=metrics_port, **flags)
            )
            channel = stack.enter_context(grpc.insecure_channel(address))
            served.append(Served(address, with_token(channel), metrics_port))
        yield served[0], served[1]


@pytest.fixture
def sides(executors: tuple[Served, Served]) -> Iterator[tuple[MoveSide, MoveSide]]:
    """A fresh plan stream on each executor (which starts it from no requests, offers or imports)."""
    a, b = (MoveSide(served, PlanStream(served.channel, holder="kv-test")) for served in executors)
    yield a, b
    a.stream.close()
    b.stream.close()


def _output(result: pb.StepResult) -> tuple[int, float, list[float]]:
    (output,) = result.outputs
    (record,) = output.logprobs
    return record.token_id, record.logprob, list(record.top_logprobs)


def _prefill_and_offer(a: MoveSide, transfer_id: str, decodes: int = 2) -> list[int]:
    """Runs PROMPT on a for a prefill and `decodes` decode steps in blocks 0..2, then offers those
    blocks; returns the tokens sampled (the last one not computed yet)."""
    new = pb.NewRequest(
        request_id="moved", token_ids=PROMPT, num_prompt_tokens=len(PROMPT), block_ids=[0, 1, 2],
        num_scheduled_tokens=len(PROMPT), sampling=GREEDY,
    )
    sampled = [_output(a.run(new_requests=[new]))[0]]
    for _ in range(decodes):
        sampled.append(_output(a.run(continuing_requests=[pb.ContinuingRequest(request_id="moved", num_scheduled_tokens=1)]))[0])
    a.run(kv_exports=[pb.KvExport(transfer_id=transfer_id, block_ids=[0, 1, 2])])
    return sampled


def _continue(side: MoveSide, steps: int, first: pb.NewRequest | None = None) -> list[tuple[int, float, list[float]]]:
    """The request's next `steps` outputs: a NewRequest first where given, then decodes."""
    outputs = []
    if first is not None:
        outputs.append(_output(side.run(new_requests=[first])))
    while len(outputs) < steps:
        decode = pb.ContinuingRequest(request_id="moved", num_scheduled_tokens=1)
        outputs.append(_output(side.run(continuing_requests=[decode])))
    return outputs


def test_a_request_moved_with_its_kv_continues_bit_for_bit(sides: tuple[MoveSide, MoveSide]) -> None:
    a, b = sides
    sampled = _prefill_and_offer(a, "move-1")
    b.run(kv_imports=[pb.KvImport(transfer_id="move-1", source_address=a.served.address, block_ids=[10, 11, 12])])
    done = b.wait_imports({"move-1"})["move-1"]
    assert done.ok, done.error
    assert done.bytes == 3 * 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    assert done.seconds > 0
    # On b: the same tokens, the prompt and the two decodes computed (by a), the last sampled
    # token scheduled.
    moved = pb.NewRequest(
        request_id="moved", token_ids=[*PROMPT, *sampled], num_prompt_tokens=len(PROMPT), block_ids=[10, 11, 12],
        num_computed_tokens=len(PROMPT) + len(sampled) - 1, num_scheduled_tokens=1, sampling=GREEDY,
    )
    there = _continue(b, 3, moved)
    here = _continue(a, 3)
    assert there == here
    # What b computes without the K/V (its blocks hold zeros): another answer, so the match
    # above is the imported K/V's doing.
    blind = pb.NewRequest(
        request_id="blind", token_ids=[*PROMPT, *sampled], num_prompt_tokens=len(PROMPT), block_ids=[20, 21, 22],
        num_computed_tokens=len(PROMPT) + len(sampled) - 1, num_scheduled_tokens=1, sampling=GREEDY,
    )
    assert _output(b.run(new_requests=[blind]))[1:] != there[0][1:]


def test_an_import_from_a_first_block_on_fills_only_the_blocks_after_a_held_prefix(sides: tuple[MoveSide, MoveSide]) -> None:
    a, b = sides
    sampled = _prefill_and_offer(a, "move-prefix")
    # b computes the first block itself (a prefix-cache hit, as the scheduler sees it), then
    # fetches the rest of the offer.
    prefix = pb.NewRequest(request_id="prefix", token_ids=PROMPT[:BLOCK_SIZE], block_ids=[10], num_scheduled_tokens=BLOCK_SIZE)
    b.run(new_requests=[prefix], dropped_request_ids=[])
    b.run(
        dropped_request_ids=["prefix"],
        kv_imports=[pb.KvImport(transfer_id="move-prefix", source_address=a.served.address, first_block=1, block_ids=[11, 12])],
    )
    done = b.wait_imports({"move-prefix"})["move-prefix"]
    assert done.ok, done.error
    assert done.bytes == 2 * 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    moved = pb.NewRequest(
        request_id="moved", token_ids=[*PROMPT, *sampled], num_prompt_tokens=len(PROMPT), block_ids=[10, 11, 12],
        num_computed_tokens=len(PROMPT) + len(sampled) - 1, num_scheduled_tokens=1, sampling=GREEDY,
    )
    assert _continue(b, 2, moved) == _continue(a, 2)


def _fetch(served: Served, transfer_id: str, metadata: tuple[tuple[str, str], ...] | None = None) -> list[pb.KvBlockChunk]:
    stub = pb_grpc.KvTransferStub(served.channel)
    return list(stub.FetchBlocks(pb.FetchBlocksRequest(transfer_id=transfer_id), metadata=metadata, timeout=10))


def test_an_offer_is_fetched_in_chunks_until_it_ends(sides: tuple[MoveSide, MoveSide]) -> None:
    a, _ = sides
    _prefill_and_offer(a, "offered")
    (chunk,) = _fetch(a.served, "offered")
    assert (chunk.first_block, chunk.num_blocks, chunk.kv_layout) == (0, 3, LAYOUT)
    assert len(chunk.data) == 3 * 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    a.run(ended_exports=["offered"])
    with pytest.raises(grpc.RpcError) as ended:
        _fetch(a.served, "offered")
    assert ended.value.code() == grpc.StatusCode.NOT_FOUND
    assert "offered" in ended.value.details()


def test_an_unknown_transfer_id_is_not_found(sides: tuple[MoveSide, MoveSide]) -> None:
    a, _ = sides
    with pytest.raises(grpc.RpcError) as unknown:
        _fetch(a.served, "never-offered")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no open offer" in unknown.value.details()


def test_a_fetch_without_the_token_is_unauthenticated(sides: tuple[MoveSide, MoveSide]) -> None:
    a, _ = sides
    _prefill_and_offer(a, "guarded")
    with grpc.insecure_channel(a.served.address) as bare:
        stub = pb_grpc.KvTransferStub(bare)
        for metadata in ((), ((EXECUTOR_TOKEN_METADATA, token()[:-1]),)):
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.FetchBlocks(pb.FetchBlocksRequest(transfer_id="guarded"), metadata=metadata, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With it, the offer is there.
        with_it = stub.FetchBlocks(
            pb.FetchBlocksRequest(transfer_id="guarded"), metadata=((EXECUTOR_TOKEN_METADATA, token()),), timeout=10
        )
        assert [chunk.num_blocks for chunk in with_it] == [3]


def test_a_failed_import_is_reported_and_disturbs_nothing_else(sides: tuple[MoveSide, MoveSide]) -> None:
    _, b = sides
    dead = f"127.0.0.1:{free_port()}"
    new = pb.NewRequest(request_id="bystander", token_ids=PROMPT, block_ids=[0, 1, 2], num_scheduled_tokens=len(PROMPT))
    # An entry that names no block of the pool fails at once, in the same plan's result.
    bad = b.run(new_requests=[new], kv_imports=[pb.KvImport(transfer_id="bad", source_address=dead, block_ids=[NUM_BLOCKS])])
    assert bad.outputs[0].token_ids
    assert [(d.transfer_id, d.ok) for d in bad.kv_imports_done] == [("bad", False)]
    assert "outside the pool" in bad.kv_imports_done[0].error
    b.run(kv_imports=[pb.KvImport(transfer_id="dead", source_address=dead, block_ids=[10])])
    failed = b.wait_imports({"dead"})["dead"]
    assert not failed.ok
    assert "UNAVAILABLE" in failed.error and dead in failed.error
    decode = b.run(continuing_requests=[pb.ContinuingRequest(request_id="bystander", num_scheduled_tokens=1)])
    assert decode.outputs[0].token_ids


def test_an_import_of_another_layout_fails(sides: tuple[MoveSide, MoveSide], model_dir: Path) -> None:
    _, b = sides
    with (
        start_executor(model_dir, num_kv_blocks=NUM_BLOCKS, block_size=2 * BLOCK_SIZE) as (address, _),
        grpc.insecure_channel(address) as channel,
    ):
        other = MoveSide(Served(address, with_token(channel), 0), PlanStream(with_token(channel), holder="kv-test"))
        new = pb.NewRequest(request_id="wide", token_ids=PROMPT, block_ids=[0, 1], num_scheduled_tokens=len(PROMPT))
        other.run(new_requests=[new], kv_exports=[pb.KvExport(transfer_id="wide", block_ids=[0, 1])])
        b.run(kv_imports=[pb.KvImport(transfer_id="wide", source_address=address, block_ids=[10, 11])])
        failed = b.wait_imports({"wide"})["wide"]
        other.stream.close()
    assert not failed.ok
    assert "kv_layout" in failed.error and "block_size=16" in failed.error


def test_a_cancelled_import_is_never_reported(sides: tuple[MoveSide, MoveSide]) -> None:
    a, b = sides
    _prefill_and_offer(a, "cancelled")
    b.run(kv_imports=[pb.KvImport(transfer_id="cancelled", source_address=a.served.address, block_ids=[10, 11, 12])])
    # Whether or not the fetch has finished by now, the cancellation comes first in its plan.
    b.run(cancelled_imports=["cancelled"])
    # A later import of the same offer still ends, and is reported alone.
    b.run(kv_imports=[pb.KvImport(transfer_id="cancelled", source_address=a.served.address, block_ids=[20, 21, 22])])
    assert b.wait_imports({"cancelled"})["cancelled"].ok
    assert [d.transfer_id for d in b.imports_done] == ["cancelled"]
    for _ in range(3):
        b.run()
    assert [d.transfer_id for d in b.imports_done] == ["cancelled"]


def test_computed_tokens_count_prompt_and_decode_and_transfers_are_counted(sides: tuple[MoveSide, MoveSide]) -> None:
    a, b = sides

    def counts(served: Served) -> dict[str, float]:
        samples, _ = scrape(served.metrics_port)
        return {
            "prompt": samples['splitserve:executor_computed_tokens_total{kind="prompt"}'],
            "decode": samples['splitserve:executor_computed_tokens_total{kind="decode"}'],
            "sent": samples['splitserve:executor_kv_transfer_bytes_total{direction="sent"}'],
            "received": samples['splitserve:executor_kv_transfer_bytes_total{direction="received"}'],
            "ok": samples['splitserve:executor_kv_imports_total{outcome="ok"}'],
            "timed": samples["splitserve:executor_kv_transfer_seconds_count"],
        }

    before_a, before_b = counts(a.served), counts(b.served)
    sampled = _prefill_and_offer(a, "counted", decodes=3)
    b.run(kv_imports=[pb.KvImport(transfer_id="counted", source_address=a.served.address, block_ids=[10, 11, 12])])
    assert b.wait_imports({"counted"})["counted"].ok
    # On b, a request with part of its prompt computed elsewhere: 5 prompt tokens left, then
    # the 4 generated ones, then one decode more.
    resumed = pb.NewRequest(
        request_id="resumed", token_ids=[*PROMPT, *sampled], num_prompt_tokens=len(PROMPT), block_ids=[20, 21, 22],
        num_computed_tokens=len(PROMPT) - 5, num_scheduled_tokens=5 + len(sampled),
    )
    b.run(new_requests=[resumed])
    b.run(continuing_requests=[pb.ContinuingRequest(request_id="resumed", num_scheduled_tokens=1)])
    after_a, after_b = counts(a.served), counts(b.served)
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    assert after_a["prompt"] - before_a["prompt"] == len(PROMPT)
    assert after_a["decode"] - before_a["decode"] == 3
    assert after_b["prompt"] - before_b["prompt"] == 5
    assert after_b["decode"] - before_b["decode"] == len(sampled) + 1
    assert after_a["sent"] - before_a["sent"] == 3 * block_bytes
    assert after_b["received"] - before_b["received"] == 3 * block_bytes
    assert (after_b["ok"] - before_b["ok"], after_b["timed"] - before_b["timed"]) == (1, 1)


def test_describe_says_the_executor_moves_kv_in_its_layout_and_role(executors: tuple[Served, Served]) -> None:
    a, b = (pb_grpc.ExecutorStub(served.channel).Describe(pb.DescribeRequest()) for served in executors)
    assert a.supports_kv_transfer and b.supports_kv_transfer
    assert a.kv_layout == b.kv_layout == LAYOUT
    assert (a.role, b.role) == ("prefill", "both")
