"""What one streamed gRPC message costs the Python server that sends it: the floor under a
front-end's CPU per delivered token while every token is its own message (--stream-interval 1).

A grpc.aio server in a child process holds S server-streaming calls open and, every tick, sends
each one 40-byte message (as a front-end sends a token); clients in this process read them. The
server's CPU (all its threads, from /proc) over the measured window, divided by the messages
delivered, is the figure: no tokenizer, no planner, nothing but gRPC and the event loop.

    python -m bench.grpc_stream_cost [--streams 256] [--tick-ms 20] [--warmup-s 3] [--measure-s 8]
        [--event-loop auto|uvloop|asyncio]

The server runs on the loop a front-end runs on by default (auto: uvloop where installed, see
scheduler_service/process/event_loop.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue

import grpc

from bench.tier_cpu import cpu_seconds
from scheduler_service.process.event_loop import EVENT_LOOPS, event_loop_runner

logger = logging.getLogger("bench.grpc_stream_cost")
SERVICE, METHOD = "bench.Stream", "Ticks"
MESSAGE = b"x" * 40


@dataclass(slots=True, frozen=True)
class StreamCost:
    streams: int
    messages_per_s: float
    server_cores: float
    server_us_per_message: float


async def _serve(tick_s: float, ports: Queue) -> None:
    tick = {"event": asyncio.Event()}

    async def ticks(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        while True:
            await tick["event"].wait()
            yield MESSAGE

    handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.unary_stream_rpc_method_handler(ticks)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    while True:
        await asyncio.sleep(tick_s)
        # Every stream waiting on the old event sends once; the next tick is a new event.
        previous, tick["event"] = tick["event"], asyncio.Event()
        previous.set()


def _server_process(tick_s: float, ports: Queue, event_loop: str) -> None:
    event_loop_runner(event_loop)(_serve(tick_s, ports))


async def _measure(port: int, pid: int, streams: int, warmup_s: float, measure_s: float) -> StreamCost:
    received = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.unary_stream(f"/{SERVICE}/{METHOD}")

        async def read() -> None:
            nonlocal received
            async for _ in method(b""):
                received += 1

        readers = [asyncio.create_task(read()) for _ in range(streams)]
        await asyncio.sleep(warmup_s)
        count, cpu, at = received, cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(measure_s)
        messages, used, window = received - count, (cpu_seconds(pid) or 0.0) - (cpu or 0.0), time.monotonic() - at
        for reader in readers:
            reader.cancel()
    if messages == 0:
        raise RuntimeError("no message reached a client in the window")
    return StreamCost(streams, messages / window, used / window, used / messages * 1e6)


def measure(streams: int, tick_s: float, warmup_s: float, measure_s: float, event_loop: str = "auto") -> StreamCost:
    ports: Queue = multiprocessing.get_context("spawn").Queue()
    server = multiprocessing.get_context("spawn").Process(
        target=_server_process, args=(tick_s, ports, event_loop), daemon=True
    )
    server.start()
    try:
        port = ports.get(timeout=60)
        assert server.pid is not None
        return asyncio.run(_measure(port, server.pid, streams, warmup_s, measure_s))
    finally:
        server.kill()
        server.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tick-ms", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=8.0)
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto", help="the server's loop (a front-end's --event-loop)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    cost = measure(args.streams, args.tick_ms / 1000, args.warmup_s, args.measure_s, args.event_loop)
    logger.info(
        "event=grpc_stream_cost streams=%d event_loop=%s messages_per_s=%.0f server_cores=%.2f server_us_per_message=%.1f",
        cost.streams, args.event_loop, cost.messages_per_s, cost.server_cores, cost.server_us_per_message,
    )


if __name__ == "__main__":
    main()
