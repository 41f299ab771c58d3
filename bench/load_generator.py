"""A load-generator process: keeps N generation streams open against a scheduler through the
client library, starting a new request whenever one ends, until told to stop (SIGTERM) or for
--duration-s.

    python -m bench.load_generator --server HOST:PORT --streams 512 [--prompt-len 64]
        [--max-tokens 256] [--ramp-s 2] [--stats-file F] [--duration-s S]

Every token counts as it arrives. With --stats-file it rewrites, as JSON, the monotonic time,
the tokens received so far, the streams finished and those that failed, and how many streams
are delivering now (their request has sent a token and not ended); a benchmark reads two
snapshots to get the rate over a window, and waits for every stream to deliver before the first
so that a window holds steady delivery, not requests still being admitted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from clients import AsyncClient, SplitserveError

logger = logging.getLogger("bench.load_generator")
STATS_INTERVAL_S = 0.05


@dataclass(slots=True)
class Counts:
    tokens: int = 0
    finished: int = 0
    failed: int = 0
    # Streams whose current request has received a token and not ended.
    delivering: int = 0
    # Longest wait between two messages of one stream, seconds.
    longest_gap_s: float = 0.0


async def keep_one_stream(
    client: AsyncClient, args: argparse.Namespace, rng: random.Random, counts: Counts, start_after_s: float
) -> None:
    await asyncio.sleep(start_after_s)
    while True:
        prompt = [rng.randrange(1, 30_000) for _ in range(args.prompt_len)]
        last = time.monotonic()
        delivering = failed = False
        try:
            async for delta in client.stream(
                prompt_token_ids=prompt, max_tokens=args.max_tokens, temperature=0, ignore_eos=True
            ):
                now = time.monotonic()
                counts.longest_gap_s = max(counts.longest_gap_s, now - last)
                last = now
                counts.tokens += len(delta.token_ids)
                if not delivering:
                    delivering = True
                    counts.delivering += 1
            counts.finished += 1
        except SplitserveError as error:
            failed = True
            counts.failed += 1
            logger.warning("event=stream_failed code=%s details=%r", error.code.name, error.details)
        finally:
            counts.delivering -= delivering
        if failed:
            await asyncio.sleep(1.0)


async def write_stats(path: Path, counts: Counts) -> None:
    partial = path.with_suffix(".partial")
    while True:
        snapshot = {"at": time.monotonic(), "tokens": counts.tokens, "finished": counts.finished,
                    "failed": counts.failed, "delivering": counts.delivering,
                    "longest_gap_s": counts.longest_gap_s}
        partial.write_text(json.dumps(snapshot))
        os.replace(partial, path)
        await asyncio.sleep(STATS_INTERVAL_S)


async def run(args: argparse.Namespace) -> Counts:
    counts = Counts()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    rng = random.Random(args.seed)
    async with AsyncClient(args.server) as client:
        tasks = [
            asyncio.create_task(keep_one_stream(client, args, rng, counts, args.ramp_s * i / args.streams))
            for i in range(args.streams)
        ]
        if args.stats_file is not None:
            tasks.append(asyncio.create_task(write_stats(args.stats_file, counts)))
        try:
            await asyncio.wait_for(stop.wait(), args.duration_s)
        except TimeoutError:
            pass
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--streams", type=int, required=True, help="streams kept open at once")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ramp-s", type=float, default=2.0, help="streams start evenly over this many seconds")
    parser.add_argument("--duration-s", type=float, default=None, help="default: until SIGTERM")
    parser.add_argument("--stats-file", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    counts = asyncio.run(run(args))
    logger.info(
        "event=load_done tokens=%d finished=%d failed=%d longest_gap_s=%.3f",
        counts.tokens, counts.finished, counts.failed, counts.longest_gap_s,
    )


if __name__ == "__main__":
    main()
