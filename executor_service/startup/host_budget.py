"""How many host-tier blocks --kv-host-gib buys (ExecutorInfo.num_host_blocks), or why this
executor refuses to start with one.

A tier that cannot work is refused rather than quietly left out: an operator who asked for one
would otherwise find out only from recomputed requests. (--tensor-parallel-size above 1 is
refused with the flags, before the model loads.)
"""

from __future__ import annotations

import logging
import os

from executor_service.attention.kv_cache import KVCacheShape
from executor_service.model.model_support import UnsupportedModel

logger = logging.getLogger(__name__)

GIB = 1 << 30


def decide_host_blocks(kv_host_gib: float, model_type: str, has_recurrent: bool, shape: KVCacheShape) -> int:
    if not kv_host_gib:
        return 0
    if has_recurrent:
        # A swapped-out request or cached prefix would come back without its recurrent state.
        raise UnsupportedModel(
            model_type, "the host tier keeps K/V blocks, not recurrent state; run it without --kv-host-gib"
        )
    budget = int(kv_host_gib * GIB)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if budget > physical:
        raise UnsupportedModel(
            model_type, f"--kv-host-gib {kv_host_gib} asks for {budget} bytes; this machine has {physical}"
        )
    block_bytes = shape.bytes_per_block()
    num_blocks = budget // block_bytes
    if not num_blocks:
        raise UnsupportedModel(
            model_type, f"--kv-host-gib {kv_host_gib} holds no block of its K/V ({block_bytes} bytes each)"
        )
    logger.info("event=kv_host_budget blocks=%d bytes_per_block=%d bytes=%d", num_blocks, block_bytes, num_blocks * block_bytes)
    return num_blocks
