"""The planner gathers tokens for one front-end into one PlannerBatch until the stream's writer
takes it: steady decodes (one token each) leave num_tokens out; once an entry has another count,
every entry's count is in it, so the front-end reads each entry's tokens back exactly."""

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
    item = link.outbox.get_nowait()
    assert item is not None and link.outbox.empty(), "one turn's tokens leave as one batch"
    return link.take(item)


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
        item = link.outbox.get_nowait()
        assert item is not None
        return link.take(item)

    assert _entries(asyncio.run(gather())) == [(7, [70, 71]), (8, [80]), (9, [90])]


def _sent(link: FrontendLink) -> list[planner_pb2.PlannerBatch | None]:
    """Everything in the outbox, as the Connect stream's writer would send it."""
    sent: list[planner_pb2.PlannerBatch | None] = []
    while not link.outbox.empty():
        item = link.outbox.get_nowait()
        sent.append(None if item is None else link.take(item))
    return sent


def test_steps_that_come_back_while_the_writer_is_busy_leave_in_one_batch() -> None:
    async def steps() -> list[planner_pb2.PlannerBatch | None]:
        link = FrontendLink("frontend", "peer", 1)
        # Three steps' tokens, each in a turn of its own, while the writer is still sending.
        for step in range(3):
            link.bulk_tokens([1, 2], [10 + step, 20 + step])
            await asyncio.sleep(0)
        return _sent(link)

    sent = asyncio.run(steps())
    assert len(sent) == 1 and sent[0] is not None
    assert _entries(sent[0]) == [(1, [10]), (2, [20]), (1, [11]), (2, [21]), (1, [12]), (2, [22])]


def test_tokens_after_the_writer_took_a_batch_go_in_the_next() -> None:
    async def steps() -> list[planner_pb2.PlannerBatch | None]:
        link = FrontendLink("frontend", "peer", 1)
        link.bulk_tokens([1], [10])
        first = link.take(link.outbox.get_nowait())  # type: ignore[arg-type]
        link.bulk_tokens([1], [11])
        return [first, *_sent(link)]

    sent = asyncio.run(steps())
    assert [_entries(batch) for batch in sent if batch is not None] == [[(1, [10])], [(1, [11])]]


def test_a_status_and_the_end_stay_in_order_with_the_tokens_around_them() -> None:
    async def steps() -> list[planner_pb2.PlannerBatch | None]:
        link = FrontendLink("frontend", "peer", 1)
        link.bulk_tokens([1], [10])
        link.status(planner_pb2.PlannerStatus(serving=False, reason="draining"))
        link.bulk_tokens([1], [11])
        link.close()
        return _sent(link)

    sent = asyncio.run(steps())
    assert len(sent) == 4 and sent[3] is None
    assert _entries(sent[0]) == [(1, [10])]  # type: ignore[arg-type]
    assert sent[1] is not None and sent[1].HasField("status") and sent[1].status.reason == "draining"
    assert _entries(sent[2]) == [(1, [11])]  # type: ignore[arg-type]
