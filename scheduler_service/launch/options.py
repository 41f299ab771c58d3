"""The launcher's command line: LaunchOptions and parse_args."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from service_support.cli_help import DefaultsHelpFormatter
from service_support.default_ports import (
    DEFAULT_EXECUTOR_PORT,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_SCHEDULER_PORT,
)
from service_support.flag_types import port_number, positive_int

DEFAULT_QUESTION = "What is the capital of France?"
DEFAULT_METRICS_PORT = 9400
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
    # None: ask nothing (serve), only print where everything listens.
    question: str | None
    # A model folder of the user's own; None prepares the default model.
    model: Path | None = None
    # Tokenizer folder for the scheduler; None: the model folder.
    tokenizer: Path | None = None
    verbose: bool = False

    @property
    def connect_host(self) -> str:
        return "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host


def default_threads() -> int:
    # One core is left to the scheduler and the client, which run beside the executor.
    return max(1, len(os.sched_getaffinity(0)) - 1)


def parse_args(
    argv: Sequence[str] | None, prog: str = "python -m scheduler_service.launch", serve: bool = False
) -> LaunchOptions:
    """serve: `splitserve serve MODEL_DIR`, the user's model and no question unless asked;
    otherwise `splitserve run`, the default model (or --model) asked the default question."""
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=DefaultsHelpFormatter,
        description="Serve a local model folder: an executor, the scheduler and the "
        "OpenAI-compatible gateway on the default ports."
        if serve
        else "Start an executor, the scheduler and the OpenAI-compatible gateway with the default "
        "model (or --model), and ask it a question.",
    )
    if serve:
        parser.add_argument(
            "model", type=Path, metavar="MODEL_DIR",
            help="local Hugging Face model folder (config.json, safetensors weights, tokenizer); "
            "nothing is downloaded",
        )
    else:
        parser.add_argument(
            "--model",
            type=Path,
            default=None,
            metavar="DIR",
            help="serve this local model folder instead of preparing the default model",
        )
        parser.add_argument(
            "--cache-dir",
            type=Path,
            default=None,
            help="where the default model is prepared (default: $SPLITSERVE_CACHE or "
            "~/.cache/splitserve/models/SmolLM2-135M-Instruct); a folder prepare-model did not "
            "write is never touched",
        )
    parser.add_argument(
        "--tokenizer", type=Path, default=None, metavar="DIR", help="tokenizer folder (default: the model folder)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address the services bind")
    parser.add_argument("--port", type=port_number, default=DEFAULT_SCHEDULER_PORT, help="scheduler; 0 = any")
    parser.add_argument("--executor-port", type=port_number, default=DEFAULT_EXECUTOR_PORT, help="executor; 0 = any")
    parser.add_argument("--metrics-port", type=port_number, default=DEFAULT_METRICS_PORT, help="scheduler's Prometheus metrics; 0 = any")
    parser.add_argument(
        "--gateway-port", type=port_number, default=DEFAULT_GATEWAY_PORT, help="OpenAI-compatible HTTP gateway; 0 = any"
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="executor torch threads (default: all cores but one)")
    parser.add_argument("--log-dir", type=Path, default=None, help="default: a new temp dir")
    parser.add_argument("--once", action="store_true", help="stop after answering the question")
    parser.add_argument(
        "--question",
        default=None if serve else DEFAULT_QUESTION,
        help="asked once everything serves" + ("" if serve else "; '' asks nothing"),
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="on a failure, show the last lines of the service's log"
    )
    args = parser.parse_args(argv)
    if not serve and args.model is not None and args.cache_dir is not None:
        parser.error("--model serves your folder as it is; --cache-dir is where the default model is prepared: give one")
    question = args.question or None
    if args.once and question is None:
        parser.error("--once needs a --question to answer")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="splitserve-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return LaunchOptions(
        cache_dir=None if serve else args.cache_dir,
        host=args.host,
        port=args.port,
        executor_port=args.executor_port,
        metrics_port=args.metrics_port,
        gateway_port=args.gateway_port,
        threads=args.threads or default_threads(),
        log_dir=log_dir,
        once=args.once,
        question=question,
        model=args.model,
        tokenizer=args.tokenizer,
        verbose=args.verbose,
    )
