"""Why the scheduler refuses a request, in terms a server maps to a status code."""

import enum


class RejectKind(enum.Enum):
    INVALID = "invalid"          # the request itself is wrong
    TOO_LARGE = "too_large"      # valid, but can never fit this deployment
    DUPLICATE = "duplicate"      # its id is already in flight


class RequestRejected(ValueError):
    def __init__(self, kind: RejectKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
