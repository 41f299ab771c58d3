"""One executor's state as the client API reports it (GetServerStatus, the Admin API)."""

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.planner.lane import ExecutorLane, LaneState

_STATES = {
    LaneState.CONNECTING: pb.EXECUTOR_STATE_UNSPECIFIED,
    LaneState.UP: pb.EXECUTOR_STATE_UP,
    LaneState.DOWN: pb.EXECUTOR_STATE_DOWN,
    LaneState.DRAINING: pb.EXECUTOR_STATE_DRAINING,
    LaneState.DRAINED: pb.EXECUTOR_STATE_DRAINED,
    LaneState.REFUSED: pb.EXECUTOR_STATE_REFUSED,
}


def executor_status(lane: ExecutorLane) -> pb.ExecutorStatus:
    status = pb.ExecutorStatus(
        address=lane.address,
        state=_STATES[lane.state],
        reason=lane.reason,
        num_steps=lane.num_steps,
    )
    if lane.info is not None:
        status.incarnation_id = lane.info.incarnation_id
        # Executors from before tensor parallelism leave these unset: one device.
        status.tensor_parallel_size = lane.info.tensor_parallel_size or 1
        status.kv_cache_bytes = lane.info.kv_cache_bytes
        status.access = lane.info.access
        status.role = lane.info.role or "both"
        status.supports_kv_transfer = lane.info.supports_kv_transfer
    scheduler = lane.scheduler
    if scheduler is not None:
        stats = scheduler.kv.stats()
        status.kv_blocks_total = stats.num_blocks
        status.kv_blocks_free = stats.num_free_blocks
        status.state_slots_total = stats.num_state_slots
        status.state_slots_free = stats.num_free_state_slots
        status.kv_host_blocks_total = stats.num_host_blocks
        status.kv_host_blocks_free = stats.num_free_host_blocks
        status.num_running = len(scheduler.running)
        status.num_waiting = scheduler.num_waiting
    return status
