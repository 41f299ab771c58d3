"""A plan of steady decodes only, admitted from the rows' tables in a few array operations.

The planner sends the same handles in the same order step after step while no request comes or
goes, so the handles' requests and rows are looked up once and kept until the handles or the
held requests change; each step then checks every row's room for its token and gathers the
step's inputs from the tables, in one C call where the rows have their kernels (RowKernels) and
in numpy's operations where not. The C call keeps the step's block table from step to step and
copies only the blocks added since, so the gather does not grow with the contexts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor_service.kernels.row_kernels import KeptTable
from executor_service.runner.request_rows import (
    COMPUTED,
    KERNEL_COLUMNS,
    LAST_TOKEN,
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
    # 0..len(rows)-1.
    order: torch.Tensor
    # Per row, gathered as admitted (after the plan's block appends): its last token (the one
    # the step computes) and its position, both [1, rows] as a forward takes them, its context
    # length once the step has run, and the cache slot its token's K/V go to; and its block
    # table, [rows, at least the most blocks a row holds], padded with block 0. They may be
    # views of RowKernels' buffer, valid until the next step.
    last_tokens: np.ndarray
    positions: np.ndarray
    context_lens: np.ndarray
    slots: np.ndarray
    table: np.ndarray
    # The block table RowKernels keeps for these rows (None without the kernels).
    kept: KeptTable | None = None


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
        """The step of these handles when every one is held, none repeats, each passes
        check_decode and every block it holds lies in the cache; None sends the caller to the
        row-by-row path for its answers."""
        step = self._step
        # The plan's repeated field compares with the kept list without being copied.
        if step is None or handles != self._handles or request_rows.version != self._version:
            step = self._look_up(list(handles), held, request_rows)
            if step is None:
                return None
        if step.kept is not None and request_rows.kernels is not None:
            gathered = request_rows.kernels.gather(
                request_rows.ints, KERNEL_COLUMNS, request_rows.blocks, step.rows, limits.block_size,
                limits.num_kv_blocks, step.kept,
            )
            if gathered is None:
                return None
            step.last_tokens, step.positions, step.context_lens, step.slots = gathered
            step.table = step.kept.table
            return step
        numpy_gathered = _gather(request_rows, step.rows, limits)
        if numpy_gathered is None:
            return None
        step.last_tokens, step.positions, step.context_lens, step.slots, step.table = numpy_gathered
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
        empty = np.zeros(0, dtype=np.int64)
        kept = KeptTable.empty(len(rows), request_rows.blocks.shape[1]) if request_rows.kernels is not None else None
        self._step = SteadyStep(states, rows, torch.arange(len(rows)), empty, empty, empty, empty, empty, kept)
        return self._step


def _gather(
    request_rows: RequestRows, rows: np.ndarray, limits: Limits
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """RowKernels.gather in numpy, the whole table gathered each step (its width the rows' table's)."""
    ints = request_rows.ints[rows]
    positions = ints[:, COMPUTED].copy()
    ends = positions + 1
    if not ((ends == ints[:, NUM_TOKENS]) & (ends <= ints[:, NUM_BLOCKS] * limits.block_size)).all():
        return None
    table = request_rows.blocks[rows]
    if table.size and (table.min() < 0 or table.max() >= limits.num_kv_blocks):
        return None
    block_size = limits.block_size
    slots = table[np.arange(len(rows)), positions // block_size] * block_size + positions % block_size
    return ints[None, :, LAST_TOKEN].copy(), positions[None, :], ends, slots, table
