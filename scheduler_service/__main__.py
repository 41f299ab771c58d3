"""Command line: python -m scheduler_service --port PORT --executor HOST:PORT [options]."""

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.service.engine import EngineOptions
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
    parser.add_argument("--executor", required=True, metavar="HOST:PORT", help="the executor to drive")
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
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        executor_address=args.executor,
        text=text,
        metrics_port=args.metrics_port,
        options=EngineOptions(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=Policy(args.policy),
            mode=StepMode(args.mode),
            max_waiting=args.max_waiting,
        ),
    )
    logger.info("event=scheduler_starting port=%d executor=%s tokenizer=%s", args.port, args.executor, args.tokenizer)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
