"""What went wrong with a request, as a kind: the one error vocabulary of the scheduler.

The core and the services say what went wrong in these terms; one table maps kinds to gRPC status
codes and back (frontend/status_codes.py).
"""

import enum
from dataclasses import dataclass


class ErrorKind(enum.Enum):
    INVALID = "invalid"            # the request itself is wrong
    UNSUPPORTED = "unsupported"    # valid, but not with this server's setup (e.g. no tokenizer)
    TOO_LARGE = "too_large"        # valid, but can never fit this deployment
    OVERLOADED = "overloaded"      # too many requests are waiting: retry later
    DUPLICATE = "duplicate"        # its id is already in flight
    UNAVAILABLE = "unavailable"    # no executor can run it now, or its executor kept failing
    INTERNAL = "internal"          # the executor failed on it
    NOT_FOUND = "not_found"        # what it names (an executor, say) does not exist


@dataclass(slots=True, frozen=True)
class RequestError:
    """Why a request ended in error: a kind and a message for its client."""

    kind: ErrorKind
    message: str


class RequestRejected(ValueError):
    """A request refused before it runs."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
