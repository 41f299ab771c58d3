"""The ranks of a tensor-parallel executor: one torch.distributed group (NCCL on CUDA, gloo on
CPU), started by the executor itself or by torchrun, in which no rank outlives another.

Rank 0 serves the Executor API; ranks 1..N-1 follow its plans (tp_steps.py). A rank that dies
takes the executor down as a whole: rank 0 watches the followers it started and exits non-zero
when one exits; a follower exits when rank 0 is gone (its parent changes, or the group's
connection breaks). Under torchrun, its agent stops every worker when one fails.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from executor_service.model.model_loader import resolve_device

logger = logging.getLogger(__name__)

# Exit status of a rank that stops because another rank died.
RANK_LOST_EXIT = 3
_PARENT_POLL_S = 0.5


@dataclass(slots=True, frozen=True)
class RankPlace:
    """Where one rank sits in the group."""

    rank: int
    world_size: int
    # Device string for this rank's weights and KV ("cpu" or "cuda:N").
    device: str


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ


def rank_device(requested: str, local_rank: int) -> str:
    """cuda:LOCAL_RANK when the executor runs on CUDA (--device, "auto" as on one device),
    else cpu."""
    return f"cuda:{local_rank}" if resolve_device(requested).type == "cuda" else "cpu"


def join_group(place: RankPlace, address: str, port: int) -> None:
    """Joins the group at address:port (rank 0 listens there); blocks until all ranks are in."""
    backend = "nccl" if place.device.startswith("cuda") else "gloo"
    if place.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(place.device))
    # transformers' tensor-parallel loading reads the rank layout from the environment.
    os.environ.update(
        RANK=str(place.rank),
        WORLD_SIZE=str(place.world_size),
        LOCAL_RANK=os.environ.get("LOCAL_RANK", str(place.rank)),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
    )
    dist.init_process_group(
        backend, init_method=f"tcp://{address}:{port}", rank=place.rank, world_size=place.world_size
    )
    logger.info(
        "event=tp_rank_joined rank=%d world_size=%d backend=%s device=%s",
        place.rank, place.world_size, backend, place.device,
    )


def free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_followers(target: object, world_size: int, args: tuple[object, ...]) -> list[torch_mp.Process]:
    """Starts ranks 1..world_size-1 as spawned processes running target(rank, *args)."""
    context = torch_mp.get_context("spawn")
    followers = []
    for rank in range(1, world_size):
        process = context.Process(target=target, args=(rank, *args), name=f"tp-rank-{rank}", daemon=True)
        process.start()
        followers.append(process)
    return followers


def watch_followers(followers: list[torch_mp.Process], stopping: threading.Event) -> threading.Thread:
    """A thread that ends this process (and the other ranks) when a follower exits while the
    executor is not stopping: no half-alive group keeps serving."""

    def watch() -> None:
        sentinels = {process.sentinel: process for process in followers}
        ended = multiprocessing.connection.wait(list(sentinels))
        if stopping.is_set():
            return
        process = sentinels[ended[0]]
        logger.error(
            "event=tp_rank_lost rank=%s exitcode=%s action=executor_exits",
            process.name.removeprefix("tp-rank-"), process.exitcode,
        )
        stop_followers(followers)
        logging.shutdown()
        os._exit(RANK_LOST_EXIT)

    thread = threading.Thread(target=watch, name="tp-watch", daemon=True)
    thread.start()
    return thread


def stop_followers(followers: list[torch_mp.Process], timeout_s: float = 5.0) -> None:
    for process in followers:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in followers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()


def exit_with_parent() -> threading.Thread:
    """A follower's thread that ends it once the rank-0 process that started it is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        logger.error("event=tp_rank_lost rank=0 action=follower_exits")
        logging.shutdown()
        os._exit(RANK_LOST_EXIT)

    thread = threading.Thread(target=watch, name="tp-parent-watch", daemon=True)
    thread.start()
    return thread


def agree_on_min(value: int) -> int:
    """The smallest of every rank's value (KV blocks sized from each rank's free memory)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def collective_device() -> torch.device:
    """Where tensors handed to the group's collectives must live."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
