"""Bitmasks that come after their plan on one Execute stream (ContinuingRequest.bitmask_follows):
the stream's reader puts them as they arrive, and the step that needs them waits for them after
its forward, so a constrained request's mask is computed while its step runs."""

from __future__ import annotations

import threading


class StreamEnded(RuntimeError):
    """The stream ended before a step's bitmasks came: the step cannot sample."""


class LateBitmasks:
    def __init__(self) -> None:
        self._ready: dict[int, dict[str, bytes]] = {}
        self._closed = False
        self._changed = threading.Condition()

    def put(self, step_id: int, bitmasks: dict[str, bytes]) -> None:
        with self._changed:
            self._ready[step_id] = bitmasks
            self._changed.notify_all()

    def close(self) -> None:
        """Wakes a step waiting for bitmasks that will never come."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def take(self, step_id: int) -> dict[str, bytes]:
        """The bitmasks of plan step_id by request, once they have come."""
        with self._changed:
            while step_id not in self._ready:
                if self._closed:
                    raise StreamEnded(f"the stream ended before the bitmasks of step {step_id} came")
                self._changed.wait()
            # Bitmasks of earlier steps that sampled none of theirs (each entry was refused).
            for stale in [step for step in self._ready if step < step_id]:
                del self._ready[stale]
            return self._ready.pop(step_id)
