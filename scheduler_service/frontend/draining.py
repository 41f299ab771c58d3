"""The rule for new requests while a scheduler (all-in-one, planner or front-end) shuts down:
refused with UNAVAILABLE, which a client retries elsewhere, while those in flight finish."""

from scheduler_service.core.errors import ErrorKind, RequestRejected

DRAINING_MESSAGE = "this scheduler is shutting down and takes no new requests; retry on another"


def refuse_when_draining(draining: bool) -> None:
    if draining:
        raise RequestRejected(ErrorKind.UNAVAILABLE, DRAINING_MESSAGE)
