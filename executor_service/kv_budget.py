"""How many KV blocks the executor holds: a given count, a byte budget, or what CUDA leaves free."""

from __future__ import annotations

import logging

import torch

from executor_service.forward import accepts_logits_to_keep, compute_logits
from executor_service.kv_cache import KVCacheShape, PagedKVCache
from executor_service.model_loader import LoadedModel
from executor_service.plan_inputs import ScheduledWork, build_step_inputs
from executor_service.request_state import RequestState
from executor_service.sampling_params import SamplingParams
from executor_service.settings import DEFAULT_CPU_KV_BYTES, ExecutorSettings

logger = logging.getLogger(__name__)


def decide_num_blocks(
    loaded: LoadedModel, shape: KVCacheShape, settings: ExecutorSettings, backend: str
) -> int:
    if settings.num_kv_blocks is not None:
        return settings.num_kv_blocks
    if settings.kv_cache_bytes is not None:
        budget = settings.kv_cache_bytes
    elif loaded.device.type == "cuda":
        budget = _cuda_budget(loaded, shape, settings, backend)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    blocks = shape.blocks_for_budget(budget)
    logger.info("event=kv_budget bytes=%d blocks=%d", budget, blocks)
    return blocks


def _cuda_budget(
    loaded: LoadedModel, shape: KVCacheShape, settings: ExecutorSettings, backend: str
) -> int:
    """Total memory times the utilization share, less the peak of a profiling step (weights and
    activations of the largest step we plan for)."""
    device = loaded.device
    num_tokens = min(settings.profile_tokens, loaded.max_model_len)
    num_blocks = -(-num_tokens // shape.block_size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cache = PagedKVCache(shape, num_blocks, device)
    state = RequestState(
        request_id="profile",
        token_ids=[0] * num_tokens,
        num_prompt_tokens=num_tokens,
        block_ids=list(range(num_blocks)),
        num_computed_tokens=0,
        sampling=SamplingParams(),
        generator=None,
    )
    inputs = build_step_inputs([ScheduledWork(state, num_tokens)], cache, backend, device)
    compute_logits(loaded, inputs, accepts_logits_to_keep(loaded))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del inputs, cache
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * settings.gpu_memory_utilization) - peak
    logger.info(
        "event=cuda_profile tokens=%d peak_bytes=%d total_bytes=%d", num_tokens, peak, total
    )
    if budget <= 0:
        raise RuntimeError(f"no memory left for the KV cache after a {num_tokens}-token step")
    return budget

