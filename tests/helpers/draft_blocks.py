"""Blocks for the steps of in-process executor tests, as the scheduler appends them: a step that
verifies drafts leaves a request's table with the blocks of its computed tokens only
(executor.proto, ContinuingRequest.draft_token_ids), so later steps bring the blocks they write.
The tests give each request a run of consecutive block ids, of which its table is a prefix."""

from __future__ import annotations

from executor_service.runner.model_runner import ModelRunner
from executor_service.runner.request_rows import RequestState
from protos.splitserve.executor.v1 import executor_pb2 as pb


def grow_blocks(runner: ModelRunner, plan: pb.StepPlan) -> pb.StepPlan:
    """The plan with the blocks each continuing entry (drafts included) and decode by handle
    needs past its request's table; entries that bring blocks, or whose request the runner does
    not hold, are left as they are."""
    for entry in plan.continuing_requests:
        state = runner.requests.get(entry.request_id)
        if state is not None and not entry.new_block_ids:
            entry.new_block_ids.extend(_next_blocks(runner, state, state.num_computed_tokens + entry.num_scheduled_tokens))
    if not plan.decode_block_handles:
        for handle in plan.decode_handles:
            state = runner.handles.get(handle)
            if state is not None:
                for block in _next_blocks(runner, state, state.num_computed_tokens + 1):
                    plan.decode_block_handles.append(handle)
                    plan.decode_block_ids.append(block)
    return plan


def _next_blocks(runner: ModelRunner, state: RequestState, end: int) -> range:
    held = state.block_ids
    needed = -(-end // runner.kv_cache.block_size) - len(held)
    return range(held[-1] + 1, held[-1] + 1 + max(0, needed))
