"""A steady decode step's bookkeeping in C (kernels/steady_rows.c): gathering its inputs from
the persistent batch's tables and writing its sampled tokens back, one call each.

runner/request_rows.py owns the tables and does the same in numpy where the library cannot be
built; tests/executor/test_row_kernels.py holds the two to the same results.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from executor_service.kernels.cpu_kernels import declare, load_kernel_library


@dataclass(slots=True)
class KeptTable:
    """A steady step's block table as steady_gather keeps it from step to step: [rows, width]
    int64, 0 past each row's blocks, and how many of each row's blocks it holds already."""

    table: np.ndarray
    held: np.ndarray

    @classmethod
    def empty(cls, rows: int, width: int) -> KeptTable:
        return cls(np.zeros((rows, width), dtype=np.int64), np.zeros(rows, dtype=np.int64))


class RowKernels:
    """steady_gather and steady_decoded with their argument types declared once, and the gather's
    output buffer, reused from step to step."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._gather = declare(
            library.steady_gather,
            [pointer, size, pointer, pointer, size, pointer, size, size, size] + [pointer] * 5 + [size, pointer],
            size,
        )
        self._decoded = declare(
            library.steady_decoded,
            [pointer, size, pointer, pointer, size, pointer, size, pointer, pointer, size, pointer, pointer, size],
            size,
        )
        self._out = np.zeros(0, dtype=np.int64)
        self._sampled = np.zeros(0, dtype=np.int64)
        self._address = _Addresses()
        # The last gather's row count and its vectors, views of _out.
        self._vectors: tuple[int, tuple[np.ndarray, ...]] = (-1, ())

    def gather(
        self,
        ints: np.ndarray,
        columns: np.ndarray,
        blocks: np.ndarray,
        rows: np.ndarray,
        block_size: int,
        num_cache_blocks: int,
        kept: KeptTable,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The rows' last tokens and positions ([1, rows], as a forward takes them), context
        lengths and slots, as steady_gather gives them (views of a buffer the next call
        overwrites), with kept's table brought up to date (started over, wider, where a row
        outgrew it); None where a row is not one token behind, lacks room, or holds a new block
        outside the cache.

        ints, blocks: C-contiguous int64 tables; columns: int64 [computed, tokens, blocks, last
        token] columns of ints; rows: int64, the rows kept was made for."""
        n = len(rows)
        if self._out.size < 4 * n:
            self._out = np.zeros(4 * n, dtype=np.int64)
            self._vectors = (-1, ())
        address = self._address
        base = address(_OUT, self._out)
        step = n * self._out.itemsize
        # A second try is on a table as wide as the rows' own, which every row fits.
        for _ in range(2):
            code = self._gather(
                address(_INTS, ints), ints.shape[1], address(_COLUMNS, columns), address(_BLOCKS, blocks),
                blocks.shape[1], address(_ROWS, rows), n, block_size, num_cache_blocks,
                base, base + step, base + 2 * step, base + 3 * step,
                address(_TABLE, kept.table), kept.table.shape[1], address(_HELD, kept.held),
            )
            if code != _TABLE_TOO_NARROW:
                break
            fresh = KeptTable.empty(n, blocks.shape[1])
            kept.table, kept.held = fresh.table, fresh.held
        if code != 0:
            return None
        if self._vectors[0] != n:
            vectors = self._out[: 4 * n].reshape(4, n)
            self._vectors = (n, (vectors[0:1], vectors[1:2], vectors[2], vectors[3]))
        last_tokens, positions, context_lens, slots = self._vectors[1]
        return last_tokens, positions, context_lens, slots

    def decoded(
        self,
        ints: np.ndarray,
        columns: np.ndarray,
        tokens: np.ndarray,
        rows: np.ndarray,
        sampled: Sequence[int],
        counts: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    ) -> int:
        """steady_decoded: 0, or the token table width the rows need (nothing written), or -1
        for a penalised token outside the vocabulary. counts: (the float32 [*, vocab] counts
        table, the penalised places in rows, their rows in the table), or None for no counting
        here. tokens: C-contiguous int32."""
        n = len(rows)
        if self._sampled.size < n:
            self._sampled = np.zeros(n, dtype=np.int64)
        self._sampled[:n] = sampled
        address = self._address
        table, penalised, counts_rows = counts if counts is not None else (None, None, None)
        return self._decoded(
            address(_INTS, ints), ints.shape[1], address(_COLUMNS, columns), address(_TOKENS, tokens), tokens.shape[1],
            address(_ROWS, rows), n, address(_SAMPLED, self._sampled),
            None if table is None else address(_COUNTS, table),
            0 if table is None else table.shape[1],
            None if penalised is None else address(_PENALISED, penalised),
            None if counts_rows is None else address(_COUNTS_ROWS, counts_rows),
            0 if penalised is None else len(penalised),
        )


# Argument kinds whose arrays _Addresses keeps.
_INTS, _COLUMNS, _BLOCKS, _ROWS, _OUT, _TABLE, _HELD, _TOKENS, _SAMPLED, _COUNTS, _PENALISED, _COUNTS_ROWS = range(12)
# steady_gather's answer when a row holds more blocks than the kept table is wide.
_TABLE_TOO_NARROW = -3


class _Addresses:
    """Each kind of argument's last array and its address. The tables, a steady step's rows and
    the output buffers stay the same objects from step to step, and numpy's .ctypes is Python code
    that costs over a microsecond a call; an array kept here keeps its memory where it is."""

    def __init__(self) -> None:
        self._arrays: list[np.ndarray | None] = [None] * 12
        self._values = [0] * 12

    def __call__(self, kind: int, array: np.ndarray) -> int:
        if array is not self._arrays[kind]:
            self._arrays[kind] = array
            self._values[kind] = array.ctypes.data
        return self._values[kind]


def load_row_kernels() -> RowKernels:
    """The kernels, with an output buffer of their own (one per RequestRows); raises
    cpu_kernels.KernelUnavailable saying why they cannot be had."""
    return RowKernels(load_kernel_library())
