"""Handles name requests on a stream in a uint32 (never 0). A stream that names more requests
than that goes on: the count wraps and skips the handles still held, so no two requests held at
once share one, and no handle outgrows its field."""

from __future__ import annotations

import asyncio

import pytest

from protos.splitserve.executor.v1 import executor_pb2
from scheduler_service.core import handles
from scheduler_service.core.handles import Handles
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.tier.planner_client import PlannerClient
from tests.helpers.sched_harness import make_request, run
from tests.scheduler.test_scheduler import config, expected_output

SMALL_LIMIT = 5


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handles, "MAX_HANDLE", SMALL_LIMIT)


def test_handles_count_from_one_then_wrap_past_the_ones_still_held(small_limit: None) -> None:
    held = {2, 4}
    taken = Handles(lambda: held)
    assert [taken.take() for _ in range(SMALL_LIMIT)] == [1, 2, 3, 4, 5]
    assert [taken.take() for _ in range(3)] == [1, 3, 5]
    # The holders at the wrap stay skipped until the next one, which asks again.
    held = {1}
    assert [taken.take() for _ in range(4)] == [2, 3, 4, 5]


def test_handles_refuse_when_every_one_is_held(small_limit: None) -> None:
    taken = Handles(lambda: range(1, SMALL_LIMIT + 1))
    for _ in range(SMALL_LIMIT):
        taken.take()
    with pytest.raises(RuntimeError, match=f"all {SMALL_LIMIT} handles are held"):
        taken.take()


def test_a_scheduler_that_names_more_requests_than_handles_keeps_them_apart(small_limit: None) -> None:
    """A long request holds handle 1 while twelve short ones pass beside it, two at a time, on
    an executor (the simulated one refuses a handle that names a request it holds, as the real
    one does): every handle fits, and every request gets the tokens it would have got alone."""
    lengths = {0: 60} | {i: 2 for i in range(1, 13)}
    arrivals = {1: [make_request(0, 6, lengths[0])]} | {3 * i: [make_request(i, 6, 2)] for i in range(1, 13)}
    result = run(config(max_num_seqs=3), arrivals)
    handles_sent = [new.handle for plan in result.plans for new in plan.new_requests]
    assert len(handles_sent) == 13 and set(handles_sent) <= set(range(1, SMALL_LIMIT + 1))
    assert not result.errors
    for i, length in lengths.items():
        assert result.outputs[f"r{i}"] == expected_output(make_request(i, 6, length).prompt_token_ids, length)


def test_a_front_end_that_names_more_requests_than_handles_keeps_them_apart(small_limit: None) -> None:
    """One stream stays open (handle 1) while twelve others open and end beside it."""

    async def streams() -> None:
        client = PlannerClient([], None, None, "frontend-1")
        client._model = executor_pb2.ExecutorInfo(max_model_len=64)
        opened = [client.open_stream(_request(i)) for i in range(3)]
        for i in range(3, 15):
            # The newer of the two short streams ends (its client went), and a new one opens.
            assert client.cancel(opened.pop())
            opened.append(client.open_stream(_request(i)))
            held = [client._handles_by_id[stream.request.request_id] for stream in opened]
            assert len(set(held)) == len(held) and set(held) <= set(range(1, SMALL_LIMIT + 1))
        await client.close()

    asyncio.run(streams())


def _request(index: int) -> Request:
    return Request(f"q{index}", [1, 2, 3], SamplingParams(max_tokens=4))
