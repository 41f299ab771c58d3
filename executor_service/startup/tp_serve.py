"""Serving a model sharded over several ranks: rank 0 serves the Executor API and broadcasts
each plan; the other ranks follow (tp_steps.py). Started by the executor itself (it spawns
ranks 1..N-1 with torch.multiprocessing) or by torchrun (every rank runs the command)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch.distributed as dist

from executor_service.model.model_support import UnsupportedModel
from executor_service.parallel.tp_group import (
    RankPlace,
    exit_with_parent,
    free_local_port,
    join_group,
    launched_by_torchrun,
    rank_device,
    start_followers,
    stop_followers,
    watch_followers,
)
from executor_service.parallel.tp_steps import PlanBroadcaster, follow_plans
from executor_service.serving.server import ServeOptions, serve, step_thread
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from protos.splitserve.executor.v1 import executor_pb2
from service_support.log_format import configure_logging

logger = logging.getLogger(__name__)

LOCAL_ADDRESS = "127.0.0.1"


@dataclass(slots=True, frozen=True)
class _ShardedExecutor:
    runner: PlanBroadcaster
    info: executor_pb2.ExecutorInfo


def serve_tensor_parallel(settings: ExecutorSettings, options: ServeOptions) -> int:
    """Runs this process's rank; rank 0 returns once it has served and stopped the others."""
    world = settings.tensor_parallel_size
    if launched_by_torchrun():
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if int(os.environ["WORLD_SIZE"]) != world:
            logger.error(
                "event=executor_refused reason=%r",
                f"torchrun started {os.environ['WORLD_SIZE']} ranks for --tensor-parallel-size {world}",
            )
            return 1
        if rank != 0:
            return _follow(RankPlace(rank, world, rank_device(settings.device, local_rank)), settings, address, port)
        followers = []
    else:
        address, port = LOCAL_ADDRESS, free_local_port()
        followers = start_followers(_spawned_follower, world, (settings, address, port))
    stopping = threading.Event()
    if followers:
        watch_followers(followers, stopping)
    place = RankPlace(0, world, rank_device(settings.device, 0))
    join_group(place, address, port)
    worker = step_thread()
    executor = worker.submit(build_executor, settings, place.device).result()
    broadcaster = PlanBroadcaster(executor.runner)
    asyncio.run(serve(_ShardedExecutor(broadcaster, executor.info), options, worker))
    stopping.set()
    broadcaster.stop()
    for process in followers:
        process.join(timeout=10.0)
    stop_followers(followers)
    dist.destroy_process_group()
    return 0


def _spawned_follower(rank: int, settings: ExecutorSettings, address: str, port: int) -> None:
    """Entry of a rank the executor started itself."""
    configure_logging(settings.log_format)
    exit_with_parent()
    sys.exit(_follow(RankPlace(rank, settings.tensor_parallel_size, rank_device(settings.device, rank)), settings, address, port))


def _follow(place: RankPlace, settings: ExecutorSettings, address: str, port: int) -> int:
    # Signals go to rank 0, which drains and then tells the followers to stop; a Ctrl-C
    # reaching the whole process group must not cut a follower out of a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    join_group(place, address, port)
    try:
        executor = build_executor(settings, place.device)
    except UnsupportedModel as refusal:
        logger.error("event=executor_refused rank=%d model_type=%s reason=%r", place.rank, refusal.model_type, refusal.reason)
        return 1
    follow_plans(executor.runner)
    dist.destroy_process_group()
    return 0
