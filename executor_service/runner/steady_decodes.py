"""A plan of steady decodes only, admitted from the rows' tables in a few array operations.

The planner sends the same handles in the same order step after step while no request comes or
goes, so the handles' requests and rows are looked up once and kept until the handles or the
held requests change; each step then checks only what moves (every row's room for one more
token).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from executor_service.runner.request_rows import RequestRows, RequestState
from executor_service.runner.validation import Limits, steady_decodes_fit


@dataclass(slots=True)
class SteadyDecodes:
    """The last admitted steady step: its handles, their requests and rows, and the rows'
    version (RequestRows.version) they were looked up at."""

    handles: list[int]
    states: list[RequestState]
    rows: np.ndarray
    version: int = -1

    def admit(
        self,
        handles: Sequence[int],
        held: Mapping[int, RequestState],
        request_rows: RequestRows,
        limits: Limits,
    ) -> tuple[list[RequestState], np.ndarray] | None:
        """The requests and rows of these handles when every one is held, none repeats and each
        passes check_decode; None sends the caller to the row-by-row path for its answers."""
        handles = list(handles)
        if handles != self.handles or request_rows.version != self.version:
            found = [held.get(handle) for handle in handles]
            if not found or None in found or len(set(handles)) != len(handles):
                return None
            self.handles = handles
            self.states = found  # type: ignore[assignment]  # no None, checked above
            self.rows = np.fromiter((state.row for state in self.states), dtype=np.int64, count=len(found))
            self.version = request_rows.version
        if not steady_decodes_fit(request_rows, self.rows, limits):
            return None
        return self.states, self.rows
