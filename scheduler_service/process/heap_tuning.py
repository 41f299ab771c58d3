"""Keeps the C heap from holding on to the buffers of big rejected requests.

glibc serves an allocation over its mmap threshold with its own mapping, returned to the system
when freed, but each such free raises the threshold (up to 32 MiB), so the next multi-megabyte
buffers (a big request's bytes inside gRPC, their Python copy) come from the heap, which
fragments and keeps them. Measured with twenty 32 MB requests refused by the caps after one
such request: +91 MiB of RSS kept with the dynamic threshold, +11 to +32 MiB with it fixed at
1 MiB (a plateau: twenty more add nothing). The scheduler makes few
allocations that large, so a mapping each costs nothing that shows; the executor, whose tensors
are large and reused every step, is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold() -> None:
    """Fixes glibc's mmap threshold at 1 MiB; does nothing (and says so) on another libc."""
    if platform.libc_ver()[0] != "glibc":
        logger.info("event=heap_tuning_skipped reason=%r", "not glibc")
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        logger.warning("event=heap_tuning_failed option=M_MMAP_THRESHOLD")
