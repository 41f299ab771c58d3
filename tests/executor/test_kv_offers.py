"""KvTransfer.FetchBlocks over an in-process grpc.aio server, with blocks of made-up bytes: an
offer goes out in chunks of whole blocks, each read on the worker thread, from the asked
position on; an offer that ends under a reader aborts its stream."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from executor_service.serving.access import ExecutorAccess
from executor_service.serving.kv_fetch import KvFetcher
from executor_service.serving.kv_moves import BlockAccess, KvMoves
from executor_service.serving.kv_transfer import KvTransferServicer
from executor_service.serving.metrics import ExecutorMetrics
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc as pb_grpc

NUM_BLOCKS = 16
# Two blocks to a chunk of at most 4 MiB.
BLOCK_BYTES = 3 << 19


def _block(block_id: int) -> bytes:
    return bytes([block_id]) * BLOCK_BYTES


async def _fetch(
    offers: list[pb.KvExport], transfer_id: str, first_block: int = 0, end_after_reads: int | None = None
) -> tuple[list[pb.KvBlockChunk], grpc.StatusCode | None, set[str]]:
    """Serves these offers and fetches one; the chunks, the status code when the stream failed,
    and the threads that read the blocks. end_after_reads: the offer ends after that many reads."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-worker")
    readers: set[str] = set()
    reads = 0

    def read(block_ids: list[int]) -> bytes:
        nonlocal reads
        readers.add(threading.current_thread().name)
        reads += 1
        if reads == end_after_reads:
            moves.before_plan(pb.StepPlan(ended_exports=[transfer_id]))
        return b"".join(_block(block) for block in block_ids)

    def write(block_ids: list[int], data: bytes) -> None:
        raise AssertionError("nothing is imported here")

    metrics = ExecutorMetrics(NUM_BLOCKS, lambda: 0)
    # A fetcher that never fetches: with none, the executor would make no offers.
    fetcher = KvFetcher("test layout", BLOCK_BYTES, None, None, lambda size: None)
    blocks = BlockAccess(read, write, "test layout", BLOCK_BYTES, NUM_BLOCKS)
    moves = KvMoves(blocks, fetcher, asyncio.get_running_loop(), metrics)
    await asyncio.get_running_loop().run_in_executor(worker, moves.before_plan, pb.StepPlan(kv_exports=offers))
    server = grpc.aio.server()
    pb_grpc.add_KvTransferServicer_to_server(KvTransferServicer(moves, worker, ExecutorAccess(insecure=True), metrics), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    chunks: list[pb.KvBlockChunk] = []
    code = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
            call = pb_grpc.KvTransferStub(channel).FetchBlocks(pb.FetchBlocksRequest(transfer_id=transfer_id, first_block=first_block))
            async for chunk in call:
                chunks.append(chunk)
    except grpc.aio.AioRpcError as error:
        code = error.code()
    finally:
        await server.stop(None)
        worker.shutdown()
    return chunks, code, readers


def test_an_offer_goes_out_in_chunks_of_whole_blocks_read_on_the_worker() -> None:
    offer = pb.KvExport(transfer_id="t", block_ids=[9, 3, 4, 12, 0])
    chunks, code, readers = asyncio.run(_fetch([offer], "t"))
    assert code is None
    assert [(c.first_block, c.num_blocks, c.kv_layout) for c in chunks] == [(0, 2, "test layout"), (2, 2, "test layout"), (4, 1, "test layout")]
    assert b"".join(c.data for c in chunks) == b"".join(_block(b) for b in offer.block_ids)
    assert len(readers) == 1 and next(iter(readers)).startswith("test-worker")


def test_a_fetch_from_a_position_sends_the_blocks_from_there() -> None:
    offer = pb.KvExport(transfer_id="t", block_ids=[9, 3, 4])
    chunks, code, _ = asyncio.run(_fetch([offer], "t", first_block=1))
    assert code is None
    assert [(c.first_block, c.num_blocks) for c in chunks] == [(1, 2)]
    assert chunks[0].data == _block(3) + _block(4)


def test_an_offer_that_ends_mid_stream_aborts_it() -> None:
    offer = pb.KvExport(transfer_id="t", block_ids=[1, 2, 3, 4, 5])
    chunks, code, _ = asyncio.run(_fetch([offer], "t", end_after_reads=1))
    assert [c.num_blocks for c in chunks] == [2]
    assert code == grpc.StatusCode.ABORTED


@pytest.mark.parametrize(
    "offer",
    [
        pb.KvExport(transfer_id="t", block_ids=[]),
        pb.KvExport(transfer_id="t", block_ids=[NUM_BLOCKS]),
        pb.KvExport(transfer_id="t", block_ids=[1, 1]),
        pb.KvExport(transfer_id="", block_ids=[1]),
    ],
)
def test_an_offer_of_bad_blocks_is_not_made(offer: pb.KvExport) -> None:
    chunks, code, readers = asyncio.run(_fetch([offer], "t"))
    assert (chunks, code, readers) == ([], grpc.StatusCode.NOT_FOUND, set())
