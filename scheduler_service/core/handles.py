"""Handles: small numbers that name requests on a stream (the executor's NewRequest.handle, the
Planner API's), uint32 on the wire and never 0.

They count up, and after MAX_HANDLE of them start again from 1, skipping those still held then: a
stream that lives to name four billion requests (weeks at a few thousand a second) must neither
fail (protobuf refuses a larger uint32) nor name two requests alike. Whoever held a handle before
the wrap and no longer holds it ended billions of requests ago, so no message about it is still
on its way."""

from collections.abc import Callable, Collection

MAX_HANDLE = 2**32 - 1


class Handles:
    __slots__ = ("_held", "_limit", "_next", "_skip")

    def __init__(self, held: Callable[[], Collection[int]]) -> None:
        """held: the handles in use now; asked only when the count wraps."""
        self._held = held
        self._next = 1
        # Read here rather than bound as a default, so that a test can lower it.
        self._limit = MAX_HANDLE
        # Handles held at the last wrap: not given out again until the next one.
        self._skip: frozenset[int] = frozenset()

    def take(self) -> int:
        wrapped = False
        while True:
            handle = self._next
            if handle > self._limit:
                if wrapped:
                    raise RuntimeError(f"all {self._limit} handles are held")
                wrapped = True
                handle = 1
                self._skip = frozenset(self._held())
            self._next = handle + 1
            if handle not in self._skip:
                return handle
