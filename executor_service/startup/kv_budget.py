"""How many KV blocks the executor holds: a given count, a byte budget, or what CUDA leaves free."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from executor_service.attention.kv_cache import KVCacheShape, PagedKVCache
from executor_service.model.model_loader import LoadedModel
from executor_service.runner.decode_graphs import decode_graphs_on
from executor_service.runner.forward import accepts_logits_to_keep, compute_logits
from executor_service.runner.plan_inputs import ScheduledWork, build_step_inputs
from executor_service.runner.request_rows import RequestRows
from executor_service.sampling.sampler import sample_batch
from executor_service.sampling.sampler_settings import SamplerSettings
from executor_service.serving.settings import DEFAULT_CPU_KV_BYTES, ExecutorSettings

logger = logging.getLogger(__name__)

# Sequences of the profiled decode step (vLLM's default max_num_seqs): its logits, one row per
# sequence, and the sampler's copies of them are the decode-time peak a prefill does not show.
PROFILE_DECODE_SEQS = 256
# Sampling of the profiled steps: every filter and penalty on, so each of their copies of the
# logits is counted (num_logprobs is set to the most a request may ask for).
_PROFILE_SAMPLING = SamplerSettings(
    temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5, want_logprobs=True
)


@dataclass(slots=True, frozen=True)
class CudaMemory:
    """The device after the profiling steps, with their cache freed."""

    total_bytes: int
    # Free on the device (mem_get_info): other processes' memory is already taken out.
    free_bytes: int
    # Held by this process's allocator: the weights and whatever else stays resident.
    own_bytes: int
    # Transient memory of the largest profiled step, above what it started with.
    step_peak_bytes: int


def cuda_kv_blocks(
    memory: CudaMemory, utilization: float, block_bytes: int, gather_bytes_per_block: int
) -> int:
    """Blocks that fit both in what is free and under the utilization cap on this process's
    total, after a step's peak; each block also reserves its share of the attention gather."""
    under_cap = int(memory.total_bytes * utilization) - memory.own_bytes
    room = min(memory.free_bytes, under_cap) - memory.step_peak_bytes
    return max(0, room // (block_bytes + gather_bytes_per_block))


def gather_bytes_per_block(
    shape: KVCacheShape, backend: str, num_heads: int, decode_graphs: bool = False
) -> int:
    """Transient bytes per cache block that attention may need at once.

    Each layer's attention gathers K and V of every context token of the batch out of the pool
    (key_cache[kv_slots]); when a decode batch spans the whole pool that is one layer's share of
    every block. Decode gathers reuse one scratch (PagedKVCache.gather_buffers) and prefill
    gathers are freed before the next layer, so one layer's worth is enough. SDPA's prefill path
    may pass a mask, which on CUDA sends grouped-query attention to the math kernel, and that
    repeats K and V for every query head of a group on top of the gather. Decode graphs gather
    into their own memory pool, at most one layer's share of every block (decode_graphs.py), so
    they add one more layer's worth.
    """
    if shape.num_layers == 0:
        return 0
    one_layer = shape.bytes_per_block() // shape.num_layers
    copies = 1 if backend == "flash_attn" else 1 + num_heads // shape.num_kv_heads
    return one_layer * (copies + int(decode_graphs))


# Most blocks a model without attention layers gets: its blocks cost no memory, and only count
# tokens for the scheduler.
MAX_COUNTING_BLOCKS = 1 << 20


def decide_num_blocks(
    loaded: LoadedModel, shape: KVCacheShape, settings: ExecutorSettings, backend: str, num_slots: int = 0
) -> int:
    """num_slots: the state slots already allocated for a model with recurrent layers (their
    memory comes out of the same budget)."""
    if settings.num_kv_blocks is not None:
        return settings.num_kv_blocks
    state_bytes = num_slots * loaded.recurrent.layout.bytes_per_slot() if loaded.recurrent else 0
    # Enough blocks for every slot's request at full length, where blocks cost nothing.
    counting = min(MAX_COUNTING_BLOCKS, max(1, num_slots) * -(-loaded.max_model_len // shape.block_size))
    if settings.kv_cache_bytes is not None:
        blocks = shape.blocks_for_budget(settings.kv_cache_bytes - state_bytes, counting)
    elif shape.num_layers == 0:
        blocks = counting
    elif loaded.device.type == "cuda":
        blocks = _cuda_blocks(loaded, shape, settings, backend, num_slots)
    else:
        blocks = shape.blocks_for_budget(DEFAULT_CPU_KV_BYTES - state_bytes, counting)
    logger.info("event=kv_budget bytes=%d blocks=%d", blocks * shape.bytes_per_block(), blocks)
    return blocks


def _cuda_blocks(
    loaded: LoadedModel, shape: KVCacheShape, settings: ExecutorSettings, backend: str, num_slots: int
) -> int:
    device = loaded.device
    num_tokens = min(settings.profile_tokens, loaded.max_model_len)
    sampling = replace(
        _PROFILE_SAMPLING, num_logprobs=min(settings.max_logprobs, loaded.vocab_size)
    )
    peak = _profile_peak(loaded, shape, num_tokens, sampling, backend, num_slots)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    memory = CudaMemory(
        total_bytes=total,
        free_bytes=free,
        own_bytes=torch.cuda.memory_reserved(device),
        step_peak_bytes=peak,
    )
    graphs = decode_graphs_on(device, settings.cuda_graph_max_batch, settings.tensor_parallel_size)
    gather = gather_bytes_per_block(shape, backend, loaded.num_heads, graphs)
    blocks = cuda_kv_blocks(
        memory, settings.gpu_memory_utilization, shape.bytes_per_block(), gather
    )
    logger.info(
        "event=cuda_profile tokens=%d decode_seqs=%d peak_bytes=%d free_bytes=%d "
        "total_bytes=%d own_bytes=%d gather_bytes_per_block=%d blocks=%d",
        num_tokens,
        PROFILE_DECODE_SEQS,
        peak,
        free,
        total,
        memory.own_bytes,
        gather,
        blocks,
    )
    if blocks <= 0:
        raise RuntimeError(f"no memory left for the KV cache after a {num_tokens}-token step")
    return blocks


def _profile_peak(
    loaded: LoadedModel,
    shape: KVCacheShape,
    num_tokens: int,
    sampling: SamplerSettings,
    backend: str,
    num_slots: int,
) -> int:
    """The larger transient peak of a num_tokens prefill and of a PROFILE_DECODE_SEQS decode
    over num_tokens of context in all, sampled with every filter on; a model with recurrent
    layers decodes as many sequences as it has slots, if fewer."""
    block_size = shape.block_size
    num_seqs = min(PROFILE_DECODE_SEQS, num_slots) if loaded.recurrent else PROFILE_DECODE_SEQS
    context = max(1, num_tokens // num_seqs)
    blocks_per_seq = -(-context // block_size)
    prefill_blocks = -(-num_tokens // block_size)
    cache = PagedKVCache(
        shape, max(prefill_blocks, num_seqs * blocks_per_seq), loaded.device, loaded.attention_layers
    )
    rows = RequestRows(loaded.vocab_size, loaded.device)
    slot = 1 if loaded.recurrent else 0
    prefill = [
        _profile_work(rows, "prefill", num_tokens, range(prefill_blocks), num_tokens, sampling, slot)
    ]
    decode = [
        _profile_work(
            rows, f"decode{i}", context, range(i * blocks_per_seq, (i + 1) * blocks_per_seq), 1, sampling, slot and i + 1
        )
        for i in range(num_seqs)
    ]
    peak = max(_step_peak(loaded, cache, work, backend) for work in (prefill, decode))
    del cache
    return peak


def _profile_work(
    rows: RequestRows,
    request_id: str,
    num_tokens: int,
    block_ids: range,
    num_scheduled: int,
    sampling: SamplerSettings,
    state_slot: int,
) -> ScheduledWork:
    state = rows.admit(
        request_id=request_id,
        token_ids=[0] * num_tokens,
        num_prompt_tokens=num_tokens,
        block_ids=block_ids,
        num_computed_tokens=num_tokens - num_scheduled,
        sampling=sampling,
        state_slot=state_slot,
    )
    return ScheduledWork(state, num_scheduled)


def _step_peak(
    loaded: LoadedModel, cache: PagedKVCache, work: list[ScheduledWork], backend: str
) -> int:
    device = loaded.device
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    inputs = build_step_inputs(work, cache, backend, device, loaded.sequence_rope, loaded.recurrent is not None)
    logits = compute_logits(loaded, inputs, accepts_logits_to_keep(loaded))
    request_rows = work[0].state.rows
    sample_batch(logits, request_rows.sampling(inputs.sampled_rows), torch.Generator(device=device))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start
