"""Can one scheduler keep many executors busy? One scheduler drives E simulated executors
(bench.sim_executor: the real executor protocol, a fixed step time, no model) with R running
requests each, the requests coming from L load-generator processes (bench.load_generator) over
real client streams, so delivering every token to a client is part of the cost. The scheduler
runs as `python -m scheduler_service --frontends N`: with 1, one process does everything; with
N >= 2, a planner process and N front-end processes behind the client port (process/all_in_one.py).
With 0, a planner alone (--role planner) whose front-ends are bench.planner_load processes that
submit and read through the Planner API in packed batches: no client streams, so this machine
can hold a load whose delivery would take more front-end cores than it has, and the planner's
cost per token is measured at the load it is meant for.

    python -m bench.scale [--executors 16] [--running 256] [--step-ms 20 5] [--frontends 1 2]
        [--load-processes 8] [--warmup-s 8] [--settle-timeout-s 120] [--measure-s 10] [--runs 3]
        [--stream-interval 1] [--json OUT]

Reported per step time and front-end count (median over runs): each executor's idle share over
the measured window (time with no plan to run: the scheduler fell behind), tokens per second the
clients received (and the executors sampled: more, while the scheduler holds tokens its streams
have not yet sent) against the rate E x R / step time that executors never waiting would give,
and the cores the scheduler used. Below the table, per configuration, the median over runs of the
scheduler's CPU per token delivered to clients (microseconds), and with N >= 2 the planner's
(the parent process) and the front-ends' (its children, together); times the rate asked, each
says how many cores that role needs. The window opens after the warm-up, once every stream
receives tokens (or the settle timeout has passed: the table says how many did), so that it
measures delivery rather than admission; CPU counts over the window only. Everything shares
this machine's cores, so it may not hold the load; CPU per delivered token depends on that much
less, which is why the costs are per token. Where the front-ends fall behind, the planner's
tokens wait for them and its cost per delivered token carries tokens not yet delivered, so its
cost per token the executors sampled is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.throughput_splitserve import wait_all_up
from bench.tier_cpu import snapshot, used_between
from tests.helpers.executor_token import token_file
from tests.helpers.scheduler_process import SchedulerProcess, scheduler_command
from tests.helpers.service_process import ServiceProcess

logger = logging.getLogger("bench.scale")
EXECUTOR_READY = re.compile(r"event=executor_ready address=(\S+):(\d+)")
PLANNER_READY = re.compile(r"event=planner_ready address=(\S+):(\d+)")
START_TIMEOUT_S = 120.0
BLOCK_SIZE = 16


@dataclass(slots=True, frozen=True)
class ScaleConfig:
    executors: int
    running: int
    step_ms: float
    load_processes: int
    prompt_len: int
    max_tokens: int
    warmup_s: float
    measure_s: float
    # Front-end processes of the scheduler (--frontends); 1: everything in one process; 0: a
    # planner alone, its front-ends played by bench.planner_load processes.
    frontends: int = 1
    # After the warm-up, how long to wait at most for every stream to be delivering.
    settle_timeout_s: float = 120.0
    # The scheduler's --stream-interval: tokens a stream gathers before they are sent. gRPC
    # costs the sender tens of microseconds a message, so this bounds the front-ends' cost.
    stream_interval: int = 1


@dataclass(slots=True, frozen=True)
class ScaleResult:
    config: ScaleConfig
    # Idle share of each executor over the window, in executor order.
    idle_shares: list[float]
    client_tokens_per_s: float
    # Tokens the executors sampled per second: above the clients' rate while the scheduler
    # holds tokens for streams it has not caught up with (or for requests that failed).
    generated_tokens_per_s: float
    ideal_tokens_per_s: float
    # Scheduler CPU seconds per wall second over the window (1.0: one core, fully used), every
    # process of it together.
    scheduler_cpu: float
    failed_streams: int
    # Streams delivering tokens when the window opened: all of them, or the window also admitted
    # requests, whose cost the per-token figures then carry too.
    delivering_streams: int
    # Microseconds of CPU per token delivered to the clients: the whole scheduler, and with
    # front-end processes (frontends >= 2) the planner's and all front-ends' together; None
    # (not applicable) with one process.
    scheduler_cpu_us_per_token: float
    planner_cpu_us_per_token: float | None
    frontend_cpu_us_per_token: float | None
    # The planner's CPU per token the executors sampled (None with one process). Where the
    # machine cannot hold the load, the front-ends fall behind and the planner's tokens wait for
    # them: per delivered token, its figure then carries tokens not yet delivered.
    planner_cpu_us_per_generated_token: float | None = None

    @property
    def worst_idle(self) -> float:
        return max(self.idle_shares)


def _us_per_token(cpu_s: float, window_s: float, tokens_per_s: float) -> float:
    return cpu_s / window_s / tokens_per_s * 1e6 if tokens_per_s > 0 else float("inf")


def _read(path: Path) -> dict[str, float]:
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.01)


def _wait_until_delivering(load_files: list[Path], streams: int, timeout_s: float) -> int:
    """How many streams deliver tokens once all do, or once timeout_s has passed: until then
    requests are still being admitted, which costs more per token than delivering does."""
    deadline = time.monotonic() + timeout_s
    while True:
        delivering = int(sum(_read(f)["delivering"] for f in load_files))
        if delivering >= streams or time.monotonic() >= deadline:
            break
        logger.info("event=settling delivering=%d streams=%d", delivering, streams)
        time.sleep(1.0)
    if delivering < streams:
        logger.warning("event=not_settled delivering=%d streams=%d timeout_s=%g", delivering, streams, timeout_s)
    return delivering


def _start_tier(config: ScaleConfig, addresses: list[str], stack: ExitStack, stats: Path) -> tuple[int, list[list[str]]]:
    """Starts the scheduler tier on the executors; returns the pid whose CPU (with its
    children's) is the tier's, and the load processes' commands, each given its share of the
    streams. With --frontends 0 the tier is a planner alone, loaded by bench.planner_load."""
    streams = config.executors * config.running
    shares = [streams // config.load_processes + (i < streams % config.load_processes) for i in range(config.load_processes)]
    flags: dict[str, object] = {
        "max_num_seqs": config.running,
        "max_num_batched_tokens": config.running * config.prompt_len,
        "max_waiting": streams * 2,
    }
    if config.frontends == 0:
        planner_token = stats / "planner-token"
        planner_token.write_text(secrets.token_hex(16) + "\n")
        command = scheduler_command(addresses, role="planner", planner_token_file=planner_token, frontends=None, **flags)
        tier: ServiceProcess = ServiceProcess(command, PLANNER_READY, "planner")
    else:
        tier = SchedulerProcess(addresses, frontends=config.frontends, stream_interval=config.stream_interval, **flags)
    stack.callback(tier.close)
    # Its log (front-ends' included) is removed when it closes: copied beside the others.
    stack.callback(shutil.copyfile, tier.log_path, stats / "scheduler.log")
    address = tier.wait_ready(START_TIMEOUT_S)
    if config.frontends == 0:
        load = ["bench.planner_load", "--planner", address, "--token-file", str(planner_token)]
        load += ["--executors", str(config.executors), "--requests"]
    else:
        wait_all_up(address, config.executors)
        load = ["bench.load_generator", "--server", address, "--streams"]
    return tier.process.pid, [
        [
            sys.executable, "-m", *load, str(share), "--prompt-len", str(config.prompt_len),
            "--max-tokens", str(config.max_tokens), "--seed", str(index),
            "--stats-file", str(stats / f"load-{index}.json"),
        ]
        for index, share in enumerate(shares)
    ]


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_once(config: ScaleConfig, workdir: Path | None = None) -> ScaleResult:
    """One run; the processes' stats files (and the load generators' and the scheduler's logs)
    go to workdir, a temporary folder when None."""
    blocks = config.running * ((config.prompt_len + config.max_tokens) // BLOCK_SIZE + 2) + 64
    with ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-scale-")))
        stats = workdir
        executors = []
        for index in range(config.executors):
            command = [
                sys.executable, "-m", "bench.sim_executor", "--port", "0",
                "--executor-token-file", str(token_file()),
                "--step-ms", str(config.step_ms), "--num-kv-blocks", str(blocks),
                "--block-size", str(BLOCK_SIZE), "--stats-file", str(stats / f"executor-{index}.json"),
            ]
            process = ServiceProcess(command, EXECUTOR_READY, f"sim-executor-{index}")
            stack.callback(process.close)
            executors.append(process)
        addresses = [process.wait_ready(START_TIMEOUT_S) for process in executors]
        streams = config.executors * config.running
        tier, load_commands = _start_tier(config, addresses, stack, stats)
        for index, command in enumerate(load_commands):
            log = stack.enter_context((stats / f"load-{index}.log").open("wb"))
            load = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            stack.callback(_stop, load)
        time.sleep(config.warmup_s)
        executor_files = [stats / f"executor-{i}.json" for i in range(config.executors)]
        load_files = [stats / f"load-{i}.json" for i in range(config.load_processes)]
        delivering = _wait_until_delivering(load_files, streams, config.settle_timeout_s)
        before = [_read(f) for f in executor_files]
        loads_before = [_read(f) for f in load_files]
        cpu_before, wall_before = snapshot(tier), time.monotonic()
        time.sleep(config.measure_s)
        after = [_read(f) for f in executor_files]
        loads_after = [_read(f) for f in load_files]
        cpu_after, wall_after = snapshot(tier), time.monotonic()
    idle = [
        1.0 - (b["busy_s"] - a["busy_s"]) / (b["at"] - a["at"]) for a, b in zip(before, after, strict=True)
    ]
    tokens_per_s, generated_per_s = (
        sum((b["tokens"] - a["tokens"]) / (b["at"] - a["at"]) for a, b in zip(first, last, strict=True))
        for first, last in ((loads_before, loads_after), (before, after))
    )
    used, window_s = used_between(cpu_before, cpu_after), wall_after - wall_before
    if used.frontends_counted != (config.frontends if config.frontends > 1 else 0):
        raise RuntimeError(
            f"counted the CPU of {used.frontends_counted} front-end processes over the window, "
            f"not {config.frontends}: one died or was restarted (see the scheduler's log)"
        )
    tier_s = used.planner_s + used.frontends_s
    split = config.frontends != 1
    return ScaleResult(
        config=config,
        idle_shares=idle,
        client_tokens_per_s=tokens_per_s,
        generated_tokens_per_s=generated_per_s,
        ideal_tokens_per_s=streams / (config.step_ms / 1000),
        scheduler_cpu=tier_s / window_s,
        failed_streams=int(sum(b["failed"] for b in loads_after)),
        delivering_streams=delivering,
        scheduler_cpu_us_per_token=_us_per_token(tier_s, window_s, tokens_per_s),
        planner_cpu_us_per_token=_us_per_token(used.planner_s, window_s, tokens_per_s) if split else None,
        frontend_cpu_us_per_token=_us_per_token(used.frontends_s, window_s, tokens_per_s) if config.frontends > 1 else None,
        planner_cpu_us_per_generated_token=_us_per_token(used.planner_s, window_s, generated_per_s) if split else None,
    )


def median_result(results: list[ScaleResult]) -> ScaleResult:
    """The run whose worst executor idle share is the median one."""
    ordered = sorted(results, key=lambda r: r.worst_idle)
    return ordered[len(ordered) // 2]


def format_table(results: list[ScaleResult]) -> str:
    lines = [
        "| step ms | executors x running | front-ends | idle median | idle worst | client tok/s | generated tok/s | ideal tok/s "
        "| scheduler CPU | delivering streams | failed streams |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        c = r.config
        lines.append(
            f"| {c.step_ms:g} | {c.executors} x {c.running} | {c.frontends} | {statistics.median(r.idle_shares):.1%} "
            f"| {r.worst_idle:.1%} | {r.client_tokens_per_s:,.0f} | {r.generated_tokens_per_s:,.0f} | {r.ideal_tokens_per_s:,.0f} "
            f"| {r.scheduler_cpu:.2f} | {r.delivering_streams} | {r.failed_streams} |"
        )
    return "\n".join(lines)


@dataclass(slots=True, frozen=True)
class RoleCost:
    role: str
    # Median over the runs of one configuration.
    us_per_token: float
    # Cores the role needs to deliver the rate the configuration asks for (E x R / step time).
    cores: float


def role_costs(runs: list[ScaleResult]) -> list[RoleCost]:
    """The whole scheduler's cost per delivered token, and with front-end processes the
    planner's and the front-ends' apart; runs are of one configuration."""
    ideal = runs[0].ideal_tokens_per_s
    figures = {"scheduler": [r.scheduler_cpu_us_per_token for r in runs]}
    if runs[0].config.frontends != 1:
        figures["planner"] = [r.planner_cpu_us_per_token or 0.0 for r in runs]
    if runs[0].config.frontends > 1:
        figures["front-ends"] = [r.frontend_cpu_us_per_token or 0.0 for r in runs]
    costs = []
    for role, values in figures.items():
        median = statistics.median(values)
        costs.append(RoleCost(role, median, ideal * median / 1e6))
    return costs


def format_costs(runs: list[ScaleResult]) -> str:
    c = runs[0].config
    parts = [f"{cost.role} {cost.us_per_token:.1f} us/token -> {cost.cores:.2f} cores" for cost in role_costs(runs)]
    generated = [r.planner_cpu_us_per_generated_token for r in runs if r.planner_cpu_us_per_generated_token is not None]
    if generated:
        parts.append(f"planner per generated token {statistics.median(generated):.1f} us")
    return (
        f"{c.step_ms:g} ms, {c.executors} x {c.running}, {c.frontends} front-end(s), "
        f"stream interval {c.stream_interval}: "
        f"{runs[0].ideal_tokens_per_s:,.0f} tok/s asked; " + "; ".join(parts)
    )


def _optional(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executors", type=int, default=16)
    parser.add_argument("--running", type=int, default=256, help="running requests per executor")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[20.0, 5.0])
    parser.add_argument(
        "--frontends", type=int, nargs="+", default=[1],
        help="the scheduler's --frontends: 1 runs it in one process, N >= 2 as a planner and N front-ends; "
        "0: a planner alone, loaded through the Planner API by bench.planner_load (no client streams)",
    )
    parser.add_argument("--load-processes", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument(
        "--settle-timeout-s", type=float, default=120.0,
        help="after the warm-up, wait at most this long for every stream to receive tokens before measuring",
    )
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--stream-interval", type=int, default=1,
        help="the scheduler's --stream-interval (tokens gathered per message to a client)",
    )
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument("--keep-dir", type=Path, help="keep the last run's stats files and the load generators' and scheduler's logs here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    medians, every_run, costs = [], [], []
    for step_ms in args.step_ms:
        for frontends in args.frontends:
            config = ScaleConfig(
                args.executors, args.running, step_ms, args.load_processes, args.prompt_len,
                args.max_tokens, args.warmup_s, args.measure_s, frontends, args.settle_timeout_s,
                args.stream_interval,
            )
            runs = []
            for index in range(args.runs):
                if args.keep_dir is not None:
                    args.keep_dir.mkdir(parents=True, exist_ok=True)
                result = run_once(config, args.keep_dir)
                logger.info(
                    "event=scale_run step_ms=%g frontends=%d run=%d worst_idle=%.3f client_tok_s=%.0f "
                    "scheduler_us_per_token=%.1f planner_us_per_token=%s frontend_us_per_token=%s",
                    step_ms, frontends, index, result.worst_idle, result.client_tokens_per_s,
                    result.scheduler_cpu_us_per_token, _optional(result.planner_cpu_us_per_token),
                    _optional(result.frontend_cpu_us_per_token),
                )
                runs.append(result)
            every_run += runs
            medians.append(median_result(runs))
            costs.append(format_costs(runs))
    print(f"median of {args.runs} runs; {os.cpu_count()} CPUs shared by every process")
    print(format_table(medians))
    print(f"CPU per token delivered to clients (median of {args.runs} runs) and the cores it takes at the rate asked:")
    print("\n".join(costs))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in every_run], indent=2))


if __name__ == "__main__":
    main()
