"""A plan's swaps between the device's blocks and the host tier's (StepPlan.swap_out_* and
swap_in_*): checked, then run before the step, after the drops and before the block copies."""

from __future__ import annotations

import logging

from executor_service.attention.host_tier import HostBlocks
from executor_service.runner.validation import Limits, swaps_problem
from protos.splitserve.executor.v1 import executor_pb2

logger = logging.getLogger(__name__)


def run_swaps(plan: executor_pb2.StepPlan, host: HostBlocks | None, limits: Limits) -> dict[int, str]:
    """Makes the plan's swap-outs, then its swap-ins. When anything is wrong with them (a
    scheduler's bug) it makes none, and returns the device blocks the swap-ins should have
    filled, each with why, so that the plan's new requests that read one are refused; the host
    blocks the swap-outs should have filled then hold nothing a later swap-in may read."""
    out_device, out_host = plan.swap_out_device_blocks, plan.swap_out_host_blocks
    in_host, in_device = plan.swap_in_host_blocks, plan.swap_in_device_blocks
    if not (out_device or out_host or in_host or in_device):
        return {}
    problem = swaps_problem(plan, limits)
    if problem is None:
        assert host is not None  # swaps_problem refuses swaps without a tier
        unfilled = host.unfilled(in_host, filled_first=out_host)
        if unfilled is None:
            host.swap_out(out_device, out_host)
            host.swap_in(in_host, in_device)
            return {}
        problem = f"host block {unfilled} holds nothing a swap-out put there"
    logger.warning("event=kv_swaps_refused step_id=%d problem=%r", plan.step_id, problem)
    if host is not None:
        host.forget([block for block in out_host if block < host.num_blocks])
    return dict.fromkeys(in_device, f"the plan's block swaps: {problem}")
