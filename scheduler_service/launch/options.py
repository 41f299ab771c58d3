"""The launcher's command line: LaunchOptions and parse_args."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from protos.cli_help import DefaultsHelpFormatter
from protos.default_ports import DEFAULT_EXECUTOR_PORT, DEFAULT_SCHEDULER_PORT
from scheduler_service.launch.ports import free_port

DEFAULT_QUESTION = "What is the capital of France?"
DEFAULT_METRICS_PORT = 9400
DEFAULT_GATEWAY_PORT = 8000
# Addresses a server binds to but a client cannot dial.
WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}


@dataclass(slots=True, frozen=True)
class LaunchOptions:
    # None leaves the choice to prepare_model ($SPLITSERVE_CACHE or its default folder).
    cache_dir: Path | None
    host: str
    port: int
    executor_port: int
    metrics_port: int
    gateway_port: int
    threads: int
    log_dir: Path
    once: bool
    question: str

    @property
    def connect_host(self) -> str:
        return "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host


def default_threads() -> int:
    # One core is left to the scheduler and the client, which run beside the executor.
    return max(1, len(os.sched_getaffinity(0)) - 1)


def parse_args(argv: Sequence[str] | None, prog: str = "python -m scheduler_service.launch") -> LaunchOptions:
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=DefaultsHelpFormatter,
        description="Start an executor and the scheduler with the default model and ask it a "
        "question.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="prepared model folder (default: $SPLITSERVE_CACHE or "
        "~/.cache/splitserve/models/SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address both services bind")
    parser.add_argument("--port", type=int, default=DEFAULT_SCHEDULER_PORT, help="scheduler; 0 = any")
    parser.add_argument("--executor-port", type=int, default=DEFAULT_EXECUTOR_PORT, help="executor; 0 = any")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, help="scheduler's Prometheus metrics")
    parser.add_argument(
        "--gateway-port", type=int, default=DEFAULT_GATEWAY_PORT, help="OpenAI-compatible HTTP gateway; 0 = any"
    )
    parser.add_argument("--threads", type=int, default=None, help="executor torch threads")
    parser.add_argument("--log-dir", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--once", action="store_true", help="stop after answering the question")
    parser.add_argument("--question", default=DEFAULT_QUESTION)
    args = parser.parse_args(argv)
    for flag in ("port", "executor_port", "metrics_port", "gateway_port"):
        if not 0 <= getattr(args, flag) <= 65535:
            parser.error(f"--{flag.replace('_', '-')} must be within 0..65535")
    if args.threads is not None and args.threads <= 0:
        parser.error("--threads must be > 0")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="splitserve-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return LaunchOptions(
        cache_dir=args.cache_dir,
        host=args.host,
        port=args.port,
        executor_port=args.executor_port,
        metrics_port=args.metrics_port or free_port(args.host),
        gateway_port=args.gateway_port,
        threads=args.threads or default_threads(),
        log_dir=log_dir,
        once=args.once,
        question=args.question,
    )
