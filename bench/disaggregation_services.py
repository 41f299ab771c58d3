"""The processes one configuration of bench.disaggregation runs: executors of the given roles
(one torch thread each) and one scheduler, each with a metrics port, and the K/V transfer
figures read from those metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from bench.compare_models import BenchModel
from bench.throughput_splitserve import wait_all_up
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.metrics_scrape import Samples, scrape, total
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import free_port

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0
BLOCK_SIZE = 16


@dataclass(slots=True, frozen=True)
class Configuration:
    name: str
    description: str
    roles: tuple[str, ...]


DISAGGREGATED = Configuration("A", "1 prefill + 1 decode executor", ("prefill", "decode"))
MIXED = Configuration("B", "2 mixed (both) executors", ("both", "both"))


@dataclass(slots=True, frozen=True)
class Services:
    address: str
    scheduler_metrics_port: int
    executor_metrics_ports: list[int]

    def scrape(self) -> tuple[Samples, list[Samples]]:
        """The scheduler's samples and each executor's."""
        return scrape(self.scheduler_metrics_port)[0], [scrape(port)[0] for port in self.executor_metrics_ports]


@contextmanager
def running(model: BenchModel, configuration: Configuration, num_kv_blocks: int, threads: int) -> Iterator[Services]:
    """Every process is stopped (SIGTERM, then SIGKILL) on any exit."""
    with ExitStack() as stack:
        ports = [free_port() for _ in configuration.roles]
        executors = []
        for role, port in zip(configuration.roles, ports, strict=True):
            executor = ExecutorProcess(
                model.path, threads=threads, dtype="float32", num_kv_blocks=num_kv_blocks,
                block_size=BLOCK_SIZE, role=role, metrics_port=port,
            )
            stack.callback(executor.close)
            executors.append(executor)
        addresses = [executor.wait_ready(START_TIMEOUT_S) for executor in executors]
        metrics_port = free_port()
        scheduler = SchedulerProcess(addresses, metrics_port=metrics_port)
        stack.callback(scheduler.close)
        address = scheduler.wait_ready(START_TIMEOUT_S)
        wait_all_up(address, len(addresses))
        logger.info("event=configuration_up name=%s roles=%s", configuration.name, ",".join(configuration.roles))
        yield Services(address, metrics_port, ports)


@dataclass(slots=True, frozen=True)
class TransferFigures:
    """K/V moved between two scrapes: the scheduler's view (a move timed from the destination
    being told to fetch to its blocks written) and the executors' (from the plan that asked for
    the import to the blocks written)."""

    moves: int
    failed_moves: int
    bytes: float
    seconds: float
    executor_bytes: float
    executor_seconds: float
    # Tokens whose K/V the moves carried (each move: its prompt).
    tokens: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def executor_gb_per_s(self) -> float:
        return self.executor_bytes / self.executor_seconds / 1e9 if self.executor_seconds else 0.0

    @property
    def bytes_per_move(self) -> float:
        return self.bytes / self.moves if self.moves else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0


def _delta(before: Samples, after: Samples, name: str) -> float:
    return total(after, name) - total(before, name)


def transfer_between(
    before: tuple[Samples, list[Samples]], after: tuple[Samples, list[Samples]], tokens_per_move: int
) -> TransferFigures:
    (scheduler_before, executors_before), (scheduler_after, executors_after) = before, after
    moves = int(_delta(scheduler_before, scheduler_after, 'splitserve:kv_moves_total{outcome="ok"}'))
    executor_pairs = list(zip(executors_before, executors_after, strict=True))
    return TransferFigures(
        moves=moves,
        failed_moves=int(_delta(scheduler_before, scheduler_after, 'splitserve:kv_moves_total{outcome="failed"}')),
        bytes=_delta(scheduler_before, scheduler_after, "splitserve:kv_transfer_bytes_total"),
        seconds=_delta(scheduler_before, scheduler_after, "splitserve:kv_transfer_seconds_sum"),
        executor_bytes=sum(
            _delta(b, a, 'splitserve:executor_kv_transfer_bytes_total{direction="received"}') for b, a in executor_pairs
        ),
        executor_seconds=sum(_delta(b, a, "splitserve:executor_kv_transfer_seconds_sum") for b, a in executor_pairs),
        tokens=moves * tokens_per_move,
    )
