"""Command line: python -m scheduler_service --port PORT --executor HOST:PORT [--executor ...]
[options]."""

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.core.router import DEFAULT_TOKENS_PER_REQUEST
from scheduler_service.service.discovery import (
    DEFAULT_RESOLVE_INTERVAL_S,
    DNS_PREFIX,
    split_target,
)
from scheduler_service.service.engine import EngineOptions
from scheduler_service.service.lane import (
    DEFAULT_STEP_TIMEOUT_FACTOR,
    DEFAULT_STEP_TIMEOUT_FLOOR_S,
    LaneOptions,
)
from scheduler_service.service.server import ServerSettings, serve
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger("scheduler_service")


def positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scheduler_service", description="Serve the splitserve Generation API.")
    parser.add_argument("--port", type=int, required=True, help="gRPC port for clients; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument(
        "--executor",
        required=True,
        action="append",
        metavar="HOST:PORT",
        help="an executor to drive (repeat for several), or dns:///NAME:PORT for every address "
        "NAME resolves to, looked up again every --resolve-interval seconds",
    )
    parser.add_argument(
        "--scheduler-id",
        help="identity presented to executors, which serve one scheduler at a time "
        "(default HOSTNAME:PORT; keep it stable so a restarted scheduler takes its executors back)",
    )
    parser.add_argument("--resolve-interval", type=float, default=DEFAULT_RESOLVE_INTERVAL_S, help="seconds between DNS lookups of dns:/// executors")
    parser.add_argument(
        "--route-tokens-per-request",
        type=int,
        default=DEFAULT_TOKENS_PER_REQUEST,
        help="routing: cached prompt tokens worth one more queued request on an executor "
        "(0: by prefix alone; large: by load alone)",
    )
    parser.add_argument(
        "--step-timeout-floor",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_FLOOR_S,
        help="seconds a step result may take before its executor counts as lost, at least "
        "(the deadline is this or --step-timeout-factor x the slowest recent step)",
    )
    parser.add_argument("--step-timeout-factor", type=float, default=DEFAULT_STEP_TIMEOUT_FACTOR)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder; without it only token-id prompts are accepted")
    parser.add_argument("--max-num-seqs", type=positive, default=256, help="most requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=positive, default=2048, help="most tokens computed per step")
    parser.add_argument("--policy", choices=[p.value for p in Policy], default="fcfs")
    parser.add_argument("--mode", choices=[m.value for m in StepMode], default="mixed")
    parser.add_argument("--max-waiting", type=positive, default=10_000, help="queue length past which requests are refused")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    args = parse_args(argv)
    text = TextProcessor.from_pretrained(args.tokenizer) if args.tokenizer else None
    for target in args.executor:
        if target.startswith(DNS_PREFIX):
            split_target(target)
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        executors=tuple(args.executor),
        text=text,
        metrics_port=args.metrics_port,
        scheduler_id=args.scheduler_id,
        resolve_interval_s=args.resolve_interval,
        options=EngineOptions(
            lane=LaneOptions(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                policy=Policy(args.policy),
                mode=StepMode(args.mode),
                step_timeout_floor_s=args.step_timeout_floor,
                step_timeout_factor=args.step_timeout_factor,
            ),
            max_waiting=args.max_waiting,
            route_tokens_per_request=args.route_tokens_per_request,
        ),
    )
    logger.info(
        "event=scheduler_starting port=%d executors=%s tokenizer=%s",
        args.port, ",".join(args.executor), args.tokenizer,
    )
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
