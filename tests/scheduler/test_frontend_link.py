"""The planner gathers a turn's tokens for one front-end into one PlannerBatch: steady decodes
(one token each) leave num_tokens out; once an entry has another count, every entry's count is
in it, so the front-end reads each entry's tokens back exactly."""

import asyncio
import itertools

from protos.splitserve.planner.v1 import planner_pb2
from scheduler_service.core.request import Request
from scheduler_service.tier.frontend_link import FrontendLink, RemoteSink


def _entries(batch: planner_pb2.PlannerBatch) -> list[tuple[int, list[int]]]:
    """As the front-end reads it (tier/planner_client.py)."""
    counts = batch.num_tokens or itertools.repeat(1)
    token_ids, offset, entries = list(batch.token_ids), 0, []
    for handle, count in zip(batch.handles, counts):
        entries.append((handle, token_ids[offset : offset + count]))
        offset += count
    return entries


async def _gather(sent: list[tuple[int, list[int]]]) -> planner_pb2.PlannerBatch:
    link = FrontendLink("frontend", "peer", 1)
    sinks = {handle: RemoteSink(Request(f"r{handle}", [1, 2, 3]), link, handle) for handle, _ in sent}
    for handle, tokens in sent:
        message, _ = sinks[handle].add_tokens(tokens, ())
        sinks[handle].send(message)
    await asyncio.sleep(0)
    batch = link.outbox.get_nowait()
    assert batch is not None and link.outbox.empty(), "one turn's tokens leave as one batch"
    return batch


def test_steady_decodes_leave_num_tokens_out() -> None:
    sent = [(1, [10]), (2, [20]), (1, [11])]
    batch = asyncio.run(_gather(sent))
    assert list(batch.num_tokens) == []
    assert _entries(batch) == sent
    assert list(batch.started) == [1, 2]


def test_an_entry_of_several_tokens_puts_every_count_in() -> None:
    sent = [(1, [10]), (2, [20]), (3, [30, 31, 32]), (1, [11]), (4, [40, 41])]
    batch = asyncio.run(_gather(sent))
    assert list(batch.num_tokens) == [1, 1, 3, 1, 2]
    assert _entries(batch) == sent


def test_a_first_entry_of_several_tokens_is_counted() -> None:
    sent = [(5, [50, 51]), (6, [60])]
    assert _entries(asyncio.run(_gather(sent))) == sent


def test_bulk_tokens_after_an_entry_of_several_tokens_are_counted_as_one_each() -> None:
    async def gather() -> planner_pb2.PlannerBatch:
        link = FrontendLink("frontend", "peer", 1)
        sink = RemoteSink(Request("r7", [1, 2, 3]), link, 7)
        sink.send(sink.add_tokens([70, 71], ())[0])
        link.bulk_tokens([8, 9], [80, 90])
        await asyncio.sleep(0)
        return link.outbox.get_nowait()

    assert _entries(asyncio.run(gather())) == [(7, [70, 71]), (8, [80]), (9, [90])]
