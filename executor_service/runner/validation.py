"""Checks of one plan entry against the executor's limits and state, touching nothing.

Each check returns a message naming the problem, or None when the entry can run.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from executor_service.runner.request_rows import (
    RequestState,
)
from executor_service.sampling.sampler_settings import SamplerSettings, sampling_problem
from protos.splitserve.executor.v1 import executor_pb2


@dataclass(slots=True, frozen=True)
class Limits:
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_logprobs: int
    # Recurrent-state slots (1..num_state_slots); 0: the model has no recurrent layers.
    num_state_slots: int = 0
    # Blocks of the host tier (--kv-host-gib); 0: no tier.
    num_host_blocks: int = 0
    # Whether a draft model proposes ContinuingRequest.num_model_drafts (--draft-model).
    draft_model: bool = False


def check_new(entry: executor_pb2.NewRequest, sampling: SamplerSettings, limits: Limits) -> str | None:
    """What is wrong with a new request, its sampling settings parsed from it already."""
    num_tokens = len(entry.token_ids)
    end = entry.num_computed_tokens + entry.num_scheduled_tokens
    problem = (
        _id_problem(entry.request_id)
        or _tokens_problem(entry.token_ids, limits)
        or _blocks_problem(entry.block_ids, limits)
        or sampling_problem(sampling, limits.max_logprobs, limits.vocab_size)
    )
    if problem:
        return problem
    if len(entry.sampling.logit_bias_token_ids) != len(entry.sampling.logit_bias_values):
        return "sampling.logit_bias_token_ids and sampling.logit_bias_values differ in length"
    if num_tokens == 0:
        return "token_ids is empty"
    if num_tokens > limits.max_model_len:
        return f"{num_tokens} tokens exceed max_model_len {limits.max_model_len}"
    if entry.num_prompt_tokens > num_tokens:
        return f"num_prompt_tokens {entry.num_prompt_tokens} exceeds the {num_tokens} token_ids"
    if len(set(entry.block_ids)) != len(entry.block_ids):
        return "block_ids repeats a block"
    if entry.num_scheduled_tokens == 0:
        return "num_scheduled_tokens must be > 0"
    if end > num_tokens:
        return f"computing up to token {end} but only {num_tokens} tokens are known"
    return (
        _state_slot_problem(entry, limits)
        or _capacity_problem(end, len(entry.block_ids), limits)
        or bitmask_problem(entry.allowed_token_bitmask, limits)
    )


def _state_slot_problem(entry: executor_pb2.NewRequest, limits: Limits) -> str | None:
    """A model with recurrent layers needs a slot for each request, and starts its state empty
    unless it names where its state is: a checkpoint to copy (state_source_slot), or its own slot
    that an import filled (state_in_slot)."""
    if not limits.num_state_slots:
        if entry.state_in_slot:
            return "state_in_slot set, but the model has no recurrent layers"
        return f"state_slot {entry.state_slot} named, but the model has no recurrent layers" if entry.state_slot else None
    if not 1 <= entry.state_slot <= limits.num_state_slots:
        return f"state_slot {entry.state_slot} outside [1, {limits.num_state_slots}] (the model has recurrent layers)"
    source = entry.state_source_slot
    if entry.state_in_slot:
        if source:
            return f"state_in_slot and state_source_slot {source} both set: the state is in the request's slot or copied, not both"
        if not entry.num_computed_tokens:
            return "state_in_slot set for a request that computes from its first token"
        return None
    if not source:
        if entry.num_computed_tokens:
            return (
                f"num_computed_tokens {entry.num_computed_tokens} without a state_source_slot: a request "
                "of a model with recurrent layers starts from empty state unless it names where its state is "
                "(or state_in_slot)"
            )
        return None
    if not 1 <= source <= limits.num_state_slots or source == entry.state_slot:
        return f"state_source_slot {source} is outside [1, {limits.num_state_slots}] or the request's own slot"
    if not entry.num_computed_tokens:
        return f"state_source_slot {source} named for a request that computes from its first token"
    return None


def checkpoint_problem(
    checkpoint: executor_pb2.StateCheckpoint, work_start: int, work_end: int, holders: Collection[int], limits: Limits
) -> str | None:
    """A StepPlan.state_checkpoints entry for a request that computes tokens
    [work_start, work_end) this step, while the slots `holders` are held by requests."""
    if not 1 <= checkpoint.slot <= limits.num_state_slots:
        return f"state checkpoint slot {checkpoint.slot} outside [1, {limits.num_state_slots}]"
    if checkpoint.slot in holders:
        return f"state checkpoint slot {checkpoint.slot} is held by a request"
    if not work_start < checkpoint.num_tokens <= work_end:
        return f"state checkpoint at {checkpoint.num_tokens} tokens, outside the ({work_start}, {work_end}] this step computes"
    return None


def check_continuing(
    entry: executor_pb2.ContinuingRequest, state: RequestState | None, limits: Limits
) -> str | None:
    if state is None:
        return "unknown request id"
    problem = _blocks_problem(entry.new_block_ids, limits)
    if problem:
        return problem
    block_ids = [*state.block_ids, *entry.new_block_ids]
    if len(set(block_ids)) != len(block_ids):
        return "new_block_ids repeats a block of the request"
    if entry.draft_bitmasks and not entry.draft_token_ids:
        return "draft_bitmasks without draft_token_ids"
    if entry.draft_token_ids or entry.num_model_drafts:
        problem = drafts_problem(entry, state, limits)
        if problem:
            return problem
    # Drafts follow the known tokens, and the step computes them too.
    num_tokens = state.num_tokens + (len(entry.draft_token_ids) or entry.num_model_drafts)
    if entry.num_scheduled_tokens == 0:
        return "num_scheduled_tokens must be > 0"
    end = state.num_computed_tokens + entry.num_scheduled_tokens
    if end > num_tokens:
        return f"computing up to token {end} but only {num_tokens} tokens are known"
    if entry.bitmask_follows and entry.allowed_token_bitmask:
        return "bitmask_follows and allowed_token_bitmask are both set"
    return _capacity_problem(end, len(block_ids), limits) or bitmask_problem(entry.allowed_token_bitmask, limits)


def drafts_problem(entry: executor_pb2.ContinuingRequest, state: RequestState, limits: Limits) -> str | None:
    """Why the executor cannot verify an entry's draft_token_ids (or the num_model_drafts its
    draft model proposes) as decodes one at a time would have sampled the same positions, or None
    when it can."""
    drafts = entry.draft_token_ids
    name = "draft_token_ids" if drafts else "num_model_drafts"
    if drafts and entry.num_model_drafts:
        return "both draft_token_ids and num_model_drafts: the drafts come from the plan or from the draft model"
    if entry.num_model_drafts and not limits.draft_model:
        return "num_model_drafts, but this executor has no draft model (--draft-model)"
    if limits.num_state_slots:
        return f"{name} for a model with recurrent layers, whose state cannot go back past a rejected draft"
    problem = _tokens_problem(drafts, limits)
    if problem:
        return f"draft_token_ids: {problem}"
    count = len(drafts) or entry.num_model_drafts
    if entry.num_scheduled_tokens != 1 + count:
        return (
            f"num_scheduled_tokens {entry.num_scheduled_tokens} with {count} {name}: a step with "
            f"drafts computes the last sampled token and each draft ({1 + count})"
        )
    if state.num_computed_tokens + 1 != state.num_tokens:
        return (
            f"{name} need every token but the last sampled one computed; {state.num_computed_tokens} "
            f"of {state.num_tokens} are"
        )
    if state.num_computed_tokens < state.num_prompt_tokens:
        return f"{name} before the request's {state.num_prompt_tokens} prompt tokens are computed"
    if entry.bitmask_follows:
        return f"{name} with bitmask_follows: the masks of a request with drafts come with them (draft_bitmasks)"
    if entry.num_model_drafts and entry.allowed_token_bitmask:
        return "num_model_drafts with an allowed-token bitmask: the draft model does not know the grammar"
    if drafts and bool(entry.allowed_token_bitmask) != bool(entry.draft_bitmasks):
        return "draft_token_ids with allowed_token_bitmask need draft_bitmasks too, and draft_bitmasks need it"
    if entry.draft_bitmasks:
        if len(entry.draft_bitmasks) != len(drafts):
            return f"{len(entry.draft_bitmasks)} draft_bitmasks for {len(drafts)} draft_token_ids: one per draft"
        for bitmask in entry.draft_bitmasks:
            problem = bitmask_problem(bitmask, limits)
            if problem:
                return f"draft_bitmasks: {problem}"
    end = state.num_computed_tokens + entry.num_scheduled_tokens
    if end > limits.max_model_len:
        return f"the drafts reach position {end - 1}, past max_model_len {limits.max_model_len}"
    return None


def copies_problem(plan: executor_pb2.StepPlan, limits: Limits) -> str | None:
    """What is wrong with a plan's block copies (copy_block_sources/destinations)."""
    sources, destinations = plan.copy_block_sources, plan.copy_block_destinations
    if len(sources) != len(destinations):
        return "copy_block_sources and copy_block_destinations differ in length"
    problem = _blocks_problem(sources, limits) or _blocks_problem(destinations, limits)
    if problem:
        return problem
    if len(set(destinations)) != len(destinations):
        return "copy_block_destinations repeats a block"
    if not set(destinations).isdisjoint(sources):
        return "a block is both copied and copied into"
    return None


def swaps_problem(plan: executor_pb2.StepPlan, limits: Limits) -> str | None:
    """What is wrong with a plan's swaps between device and host blocks (swap_out_*, swap_in_*)."""
    if not limits.num_host_blocks:
        return "the plan swaps blocks, but this executor has no host tier (--kv-host-gib)"
    pairs = (
        ("swap_out_device_blocks and swap_out_host_blocks", plan.swap_out_device_blocks, plan.swap_out_host_blocks),
        ("swap_in_host_blocks and swap_in_device_blocks", plan.swap_in_device_blocks, plan.swap_in_host_blocks),
    )
    for names, device, host in pairs:
        if len(device) != len(host):
            return f"{names} differ in length"
        problem = _blocks_problem(device, limits) or _host_blocks_problem(host, limits)
        if problem:
            return problem
    return None


def check_decode_block(block_id: int, state: RequestState, limits: Limits) -> str | None:
    """A block appended to a steady decode."""
    problem = _blocks_problem((block_id,), limits)
    if problem:
        return problem
    if block_id in state.block_ids:
        return f"block {block_id} appended twice to the request"
    return None


def check_decode(state: RequestState, limits: Limits) -> str | None:
    """A steady decode: one token, the last one known, computed and the next sampled."""
    end = state.num_computed_tokens + 1
    if end != state.num_tokens:
        return (
            f"a steady decode needs every token but the last computed; {state.num_computed_tokens} "
            f"of {state.num_tokens} are"
        )
    return _capacity_problem(end, len(state.block_ids), limits)


def _id_problem(request_id: str) -> str | None:
    return None if request_id else "request_id is empty"


def _tokens_problem(token_ids: Iterable[int], limits: Limits) -> str | None:
    bad = [t for t in token_ids if t >= limits.vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocab [0, {limits.vocab_size})"
    return None


def _blocks_problem(block_ids: Iterable[int], limits: Limits) -> str | None:
    bad = [b for b in block_ids if b >= limits.num_kv_blocks]
    if bad:
        return f"block id {bad[0]} outside the pool [0, {limits.num_kv_blocks})"
    return None


def _host_blocks_problem(block_ids: Iterable[int], limits: Limits) -> str | None:
    bad = [b for b in block_ids if b >= limits.num_host_blocks]
    if bad:
        return f"host block id {bad[0]} outside the host tier [0, {limits.num_host_blocks})"
    return None


def _capacity_problem(end: int, num_blocks: int, limits: Limits) -> str | None:
    capacity = num_blocks * limits.block_size
    if end > capacity:
        return f"{end} tokens do not fit in {num_blocks} blocks ({capacity} slots)"
    return None


def bitmask_problem(bitmask: bytes, limits: Limits) -> str | None:
    """An allowed-token bitmask: empty (no constraint), or one bit per token in 32-bit words,
    at least one token allowed."""
    if not bitmask:
        return None
    words = -(-limits.vocab_size // 32)
    if len(bitmask) != 4 * words:
        return (
            f"allowed_token_bitmask has {len(bitmask)} bytes; the vocab of {limits.vocab_size} "
            f"needs {words} 32-bit words ({4 * words} bytes)"
        )
    if not bitmask.strip(b"\0"):
        return "allowed_token_bitmask allows no token"
    return None
