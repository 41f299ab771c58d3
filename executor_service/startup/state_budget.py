"""How many recurrent-state slots a model with recurrent layers gets, and what they leave of the
memory budget for KV blocks.

A slot holds one running request's state in every recurrent layer, whatever its length, so the
count bounds how many such requests run at once, as max_num_seqs does. By default the slots take
at most half of the budget (the rest is KV blocks, for the attention layers), and no more than 256
(vLLM's default max_num_seqs): a small model gets 256, a large one as many as half the budget
holds.
"""

from __future__ import annotations

import logging

import torch

from executor_service.model.model_support import UnsupportedModel
from executor_service.serving.settings import DEFAULT_CPU_KV_BYTES, ExecutorSettings

logger = logging.getLogger(__name__)

MAX_AUTO_SLOTS = 256
STATE_SHARE = 0.5
# The start-up self-check runs two sequences side by side.
MIN_SLOTS = 2


def memory_budget(settings: ExecutorSettings, device: torch.device) -> int:
    """The bytes that KV blocks and state slots share: --kv-cache-memory, else on CUDA the free
    memory under the utilization cap, else the CPU default."""
    if settings.kv_cache_bytes is not None:
        return settings.kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * settings.gpu_memory_utilization)
    return DEFAULT_CPU_KV_BYTES


def decide_num_slots(model_type: str, slot_bytes: int, settings: ExecutorSettings, budget_bytes: int) -> int:
    if settings.state_slots is not None:
        if settings.state_slots < MIN_SLOTS:
            raise UnsupportedModel(model_type, f"--state-slots must be at least {MIN_SLOTS} (the start-up self-check runs two sequences)")
        slots = settings.state_slots
    else:
        fits = int(budget_bytes * STATE_SHARE) // max(1, slot_bytes)
        if fits < MIN_SLOTS:
            raise UnsupportedModel(
                model_type,
                f"{MIN_SLOTS} requests' recurrent state ({slot_bytes} bytes each) exceed half the memory "
                f"budget of {budget_bytes} bytes; raise --kv-cache-memory or set --state-slots",
            )
        slots = min(MAX_AUTO_SLOTS, fits)
    logger.info("event=state_budget slots=%d bytes_per_slot=%d bytes=%d", slots, slot_bytes, slots * slot_bytes)
    return slots
