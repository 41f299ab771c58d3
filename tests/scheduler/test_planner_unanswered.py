"""A front-end passes GetServerStatus and Abort on to its planner; when the planner does not
answer (lost, and not yet replaced), the client gets the planner's code, UNAVAILABLE, which it
may retry, and a message naming the planner, not gRPC's UNKNOWN for a handler's exception."""

import asyncio

import pytest

from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.tier.planner_client import PlannerClient
from tests.helpers.service_process import free_port


@pytest.mark.parametrize("call", ["server_status", "abort_request"])
def test_a_planner_that_does_not_answer_is_unavailable(call: str) -> None:
    address = f"127.0.0.1:{free_port()}"

    async def ask() -> RequestRejected:
        client = PlannerClient([address], None, None, "frontend-1")
        # Chosen while it was up; its process is gone now.
        client.current = client.links[0]
        try:
            with pytest.raises(RequestRejected) as refused:
                if call == "server_status":
                    await client.server_status()
                else:
                    await client.abort_request("someone-elses-request")
        finally:
            await client.close()
        return refused.value

    refused = asyncio.run(ask())
    assert refused.kind is ErrorKind.UNAVAILABLE
    assert f"the planner at {address} did not answer: UNAVAILABLE" in str(refused)
