"""How the ranks of a tensor-parallel executor run each step together.

Rank 0 takes plans from the scheduler and broadcasts each one (its serialized bytes) before
running it; the other ranks receive and run the same plan, so every rank makes the same
collectives in the same order. Every rank's forward ends in the same gathered logits, and the
tokens rank 0 samples are broadcast so every rank feeds the same tokens to the next step.

A step that fails on one rank leaves the others inside a collective it never joins, so a
failed step ends the executor (exit RANK_LOST_EXIT) rather than failing just its requests as a
single-device executor does; the other ranks follow it down (tp_group.py).
"""

from __future__ import annotations

import enum
import logging
import os
import time

import torch
import torch.distributed as dist

from executor_service.parallel.tp_group import RANK_LOST_EXIT, collective_device
from executor_service.runner.late_bitmasks import LateBitmasks
from executor_service.runner.model_runner import ModelRunner
from protos.splitserve.executor.v1 import executor_pb2

logger = logging.getLogger(__name__)
# How long a failed step waits for a rank watcher to report a lost rank before ending the
# executor itself: the watchers wake on the lost process's sentinel, well within this.
RANK_LOSS_GRACE_S = 2.0
# Why blocks are never read or written as bytes here (ExecutorInfo.supports_kv_transfer is off).
_SHARDED_KV = "each rank holds only its own heads' K/V: a sharded executor moves no blocks"


class _Command(enum.IntEnum):
    PLAN = 0
    DROP_ALL = 1
    STOP = 2
    DROP_ALL_AND_WIPE = 3


class PlanBroadcaster:
    """Rank 0's StepRunner: each plan goes to every rank, then runs here."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, plan: executor_pb2.StepPlan, late: LateBitmasks | None = None) -> executor_pb2.StepResult:
        """late: the bitmasks that follow the plan; only rank 0 waits for them, since its tokens
        are every rank's."""
        _send(_Command.PLAN, plan.SerializeToString())
        return _unless_failed(self.runner.execute(plan, late), rank=0)

    def drop_all_requests(self, wipe_kv: bool = False) -> None:
        # Every rank holds its own heads' K/V: each wipes its own.
        _send(_Command.DROP_ALL_AND_WIPE if wipe_kv else _Command.DROP_ALL)
        self.runner.drop_all_requests(wipe_kv)

    def num_kv_blocks_in_use(self) -> int:
        return self.runner.num_kv_blocks_in_use()

    def graphed_steps(self) -> int:
        return self.runner.graphed_steps()

    def state_slots_in_use(self) -> tuple[int, int]:
        return self.runner.state_slots_in_use()

    def computed_tokens(self) -> tuple[int, int]:
        return self.runner.computed_tokens()

    def swapped_blocks(self) -> tuple[int, int]:
        return self.runner.swapped_blocks()

    def read_blocks(self, block_ids: list[int]) -> bytes:
        raise NotImplementedError(_SHARDED_KV)

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        raise NotImplementedError(_SHARDED_KV)

    def read_state(self, slot: int) -> bytes:
        raise NotImplementedError(_SHARDED_KV)

    def write_state(self, slot: int, data: bytes) -> None:
        raise NotImplementedError(_SHARDED_KV)

    def stop(self) -> None:
        """Ends the followers' loops (on the thread that ran the plans)."""
        _send(_Command.STOP)


def follow_plans(runner: ModelRunner) -> None:
    """A follower rank's loop: runs what rank 0 broadcasts until it says stop."""
    steps = 0
    while True:
        command, payload = _receive()
        if command is _Command.STOP:
            logger.info("event=tp_follower_stopped steps=%d", steps)
            return
        if command in (_Command.DROP_ALL, _Command.DROP_ALL_AND_WIPE):
            runner.drop_all_requests(wipe_kv=command is _Command.DROP_ALL_AND_WIPE)
            continue
        _unless_failed(runner.execute(executor_pb2.StepPlan.FromString(payload)), rank=dist.get_rank())
        steps += 1


def rank0_tokens(token_ids: list[int]) -> list[int]:
    """Rank 0's sampled tokens, on every rank (ModelRunner's token agreement under TP)."""
    tokens = torch.tensor(token_ids, dtype=torch.int64, device=collective_device())
    dist.broadcast(tokens, src=0)
    return tokens.tolist()


def _unless_failed(result: executor_pb2.StepResult, rank: int) -> executor_pb2.StepResult:
    if result.HasField("failure"):
        # A failed step is most often a lost rank, whose collective broke: its watcher
        # (tp_group.watch_followers on rank 0, exit_with_parent on the others) names the rank
        # and ends this process, so it gets the first word. Under load the step used to win the
        # race and the log said only that a step failed.
        time.sleep(RANK_LOSS_GRACE_S)
        logger.error(
            "event=tp_step_failed rank=%d step_id=%d error=%r action=executor_exits",
            rank, result.step_id, result.failure.message,
        )
        logging.shutdown()
        os._exit(RANK_LOST_EXIT)
    return result


def _send(command: _Command, payload: bytes = b"") -> None:
    device = collective_device()
    dist.broadcast(torch.tensor([int(command), len(payload)], dtype=torch.int64, device=device), src=0)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device), src=0)


def _receive() -> tuple[_Command, bytes]:
    device = collective_device()
    header = torch.empty(2, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    command, length = _Command(int(header[0])), int(header[1])
    if not length:
        return command, b""
    payload = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    return command, payload.cpu().numpy().tobytes()
