"""A plan of steady decodes only, admitted from the rows' tables in a few array operations.

The planner sends the same handles in the same order step after step while no request comes or
goes, so the handles' requests and rows are looked up once and kept until the handles or the
held requests change; each step then gathers the rows' counters once, checks what moves (every
row's room for one more token), builds the step's inputs from that snapshot and writes it back
once the tokens are in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor_service.runner.request_rows import (
    COMPUTED,
    NUM_BLOCKS,
    NUM_TOKENS,
    RequestRows,
    RequestState,
)
from executor_service.runner.validation import Limits


@dataclass(slots=True)
class SteadyStep:
    """One admitted step of steady decodes."""

    states: list[RequestState]
    rows: np.ndarray
    # The rows' RequestRows.ints as admitted (after the plan's block appends), for the inputs
    # and for RequestRows.decoded to write back.
    ints: np.ndarray
    # 0..len(rows)-1, as numpy and torch indices.
    order: np.ndarray
    torch_order: torch.Tensor


class SteadyDecodes:
    """The last admitted steady step's handles and what they named, valid while RequestRows'
    version is the one they were looked up at."""

    def __init__(self) -> None:
        self._handles: list[int] = []
        self._version = -1
        self._step: SteadyStep | None = None

    def admit(
        self,
        handles: Sequence[int],
        held: Mapping[int, RequestState],
        request_rows: RequestRows,
        limits: Limits,
    ) -> SteadyStep | None:
        """The step of these handles when every one is held, none repeats and each passes
        check_decode; None sends the caller to the row-by-row path for its answers."""
        step = self._step
        # The plan's repeated field compares with the kept list without being copied.
        if step is None or handles != self._handles or request_rows.version != self._version:
            step = self._look_up(list(handles), held, request_rows)
            if step is None:
                return None
        step.ints = ints = request_rows.ints[step.rows]
        # check_decode for every row at once.
        end = ints[:, COMPUTED] + 1
        if not ((end == ints[:, NUM_TOKENS]) & (end <= ints[:, NUM_BLOCKS] * limits.block_size)).all():
            return None
        return step

    def _look_up(
        self, handles: list[int], held: Mapping[int, RequestState], request_rows: RequestRows
    ) -> SteadyStep | None:
        self._step = None
        found = [held.get(handle) for handle in handles]
        if not found or None in found or len(set(handles)) != len(handles):
            return None
        states: list[RequestState] = found  # type: ignore[assignment]  # no None, checked above
        rows = np.fromiter((state.row for state in states), dtype=np.int64, count=len(states))
        self._handles, self._version = handles, request_rows.version
        self._step = SteadyStep(states, rows, rows, np.arange(len(rows)), torch.arange(len(rows)))
        return self._step
