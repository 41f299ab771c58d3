"""How many varints a packed run holds, read from its bytes without decoding them: every varint
ends with its first byte under 0x80, and protobuf reads one of at most MAX_VARINT_BYTES bytes."""

from __future__ import annotations

import numpy as np

MAX_VARINT_BYTES = 10
# Bytes looked at at once: numpy's temporaries stay under glibc's mmap threshold (1 MiB, see
# process/heap_tuning.py), so they come from memory the allocator reuses instead of fresh pages.
PIECE_BYTES = 256 << 10


def piece_end(run: memoryview, start: int) -> int:
    """Where a piece of run beginning at start ends: about PIECE_BYTES on, just past the end of
    a varint (or where no varint can reach, for a run that is not well-formed)."""
    end = min(len(run), start + PIECE_BYTES)
    reach = min(len(run), end + MAX_VARINT_BYTES)
    while end < reach and run[end - 1] >= 0x80:
        end += 1
    return end


def count_varints(piece: memoryview) -> int | None:
    """The varints a piece holds, or None when it is not a whole number of well-formed ones."""
    if not piece:
        return 0
    high = np.frombuffer(piece, np.uint8) >= 0x80
    if high[-1]:
        return None
    if len(high) >= MAX_VARINT_BYTES:
        # MAX_VARINT_BYTES continuation bytes in a row make a varint too long.
        run = high[: len(high) - MAX_VARINT_BYTES + 1].copy()
        for offset in range(1, MAX_VARINT_BYTES):
            run &= high[offset : len(high) - MAX_VARINT_BYTES + 1 + offset]
        if run.any():
            return None
    return len(high) - int(np.count_nonzero(high))
