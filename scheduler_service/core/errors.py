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
    # Seconds after which the same request may succeed (a quota, a predicted deadline miss);
    # None: no hint.
    retry_after_s: float | None = None


class RequestRejected(ValueError):
    """A request refused before it runs; retry_after_s as in RequestError."""

    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s

    def as_error(self) -> RequestError:
        return RequestError(self.kind, str(self), self.retry_after_s)


class AdmissionRefused(RequestRejected):
    """Refused by a tenant's quota or a deadline's forecast; reason names which, for metrics
    (max_waiting, tokens_per_minute, deadline, tpot)."""

    def __init__(self, reason: str, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(kind, message, retry_after_s)
        self.reason = reason
