"""A simulated executor process: the real executor gRPC service over a runner that spends a fixed
time on each step and samples a made-up token, with no model, so a scheduler can be driven at a
scale no model on this machine reaches.

    python -m bench.sim_executor --port P --step-ms 20 [--num-kv-blocks N] [--stats-file F]

It keeps each request's token count as the plans describe it and answers every entry and steady
decode the way the real executor does (unknown ids are refused, an unheld handle is answered with
UNHELD_DECODE_TOKEN), so to a scheduler it differs only in its tokens. With --stats-file it writes
after each step, as JSON, the monotonic time and the seconds it spent busy so far: the share of a
window it was idle is 1 - (busy at end - busy at start) / (time at end - time at start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from executor_service.runner.late_bitmasks import LateBitmasks
from executor_service.serving.access import ExecutorAccess
from executor_service.serving.server import ServeOptions, serve, step_thread
from protos import rpc_codes
from protos.executor_access import read_token_file
from protos.limits import UNHELD_DECODE_TOKEN
from protos.splitserve.executor.v1 import executor_pb2

logger = logging.getLogger("bench.sim_executor")
VOCAB_SIZE = 32_000
# Never sampled, so requests end by length only.
EOS_TOKEN_ID = 0
# Snapshots written at most this often (seconds): cheap, and fine-grained against a 10 s window.
STATS_INTERVAL_S = 0.05


@dataclass(slots=True)
class _Held:
    request_id: str
    num_tokens: int
    num_computed: int
    handle: int
    # Its block table as the plans build it, for the scheduler's audit (Admin/Audit).
    block_ids: list[int] = field(default_factory=list)
    # What its tokens vary with besides their position (_token): its id's hash, taken once.
    seed: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.seed = zlib.crc32(self.request_id.encode())


@dataclass(slots=True, frozen=True)
class SimulatedExecutor:
    """What server.serve needs: a runner and the ExecutorInfo that describes it."""

    runner: TimedRunner
    info: executor_pb2.ExecutorInfo


class TimedRunner:
    """Runs plans on the server's worker thread: each plan with work takes step_s."""

    def __init__(self, step_s: float, stats_file: Path | None) -> None:
        self.step_s = step_s
        self.stats_file = stats_file
        self.requests: dict[str, _Held] = {}
        self.handles: dict[int, _Held] = {}
        self.busy_s = 0.0
        self.steps = 0
        self.tokens = 0
        self._written_at = 0.0

    def drop_all_requests(self, wipe_kv: bool = False) -> None:
        # Simulated: no K/V to wipe.
        self.requests.clear()
        self.handles.clear()

    def num_kv_blocks_in_use(self) -> int:
        # Simulated: no KV is held.
        return 0

    def graphed_steps(self) -> int:
        # Simulated: no forward at all.
        return 0

    def state_slots_in_use(self) -> tuple[int, int]:
        # Simulated: no recurrent layers.
        return 0, 0

    def computed_tokens(self) -> tuple[int, int]:
        # Simulated: no forward computes anything.
        return 0, 0

    def swapped_blocks(self) -> tuple[int, int]:
        # Simulated: no host tier (ExecutorInfo.num_host_blocks is 0).
        return 0, 0

    def read_blocks(self, block_ids: list[int]) -> bytes:
        raise NotImplementedError("a simulated executor holds no K/V (supports_kv_transfer is off)")

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        raise NotImplementedError("a simulated executor holds no K/V (supports_kv_transfer is off)")

    def read_state(self, slot: int) -> bytes:
        raise NotImplementedError("a simulated executor holds no recurrent state (num_state_slots is 0)")

    def write_state(self, slot: int, data: bytes) -> None:
        raise NotImplementedError("a simulated executor holds no recurrent state (num_state_slots is 0)")

    def execute(self, plan: executor_pb2.StepPlan, late: LateBitmasks | None = None) -> executor_pb2.StepResult:
        """late: unused; this executor does not say it takes bitmasks after their plans."""
        started = time.monotonic()
        for request_id in plan.dropped_request_ids:
            self._forget(request_id)
        result = executor_pb2.StepResult(step_id=plan.step_id)
        for new in plan.new_requests:
            self._forget(new.request_id)
            held = _Held(new.request_id, len(new.token_ids), new.num_computed_tokens, new.handle, list(new.block_ids))
            self.requests[new.request_id] = held
            if new.handle:
                self.handles[new.handle] = held
            self._advance(held, new.num_scheduled_tokens, result)
        for cont in plan.continuing_requests:
            known = self.requests.get(cont.request_id)
            if known is None:
                result.rejected.add(
                    request_id=cont.request_id, code=rpc_codes.INVALID_ARGUMENT, message="unknown request id"
                )
                continue
            known.block_ids.extend(cont.new_block_ids)
            self._advance(known, cont.num_scheduled_tokens, result)
        for handle, block_id in zip(plan.decode_block_handles, plan.decode_block_ids, strict=True):
            if handle in self.handles:
                self.handles[handle].block_ids.append(block_id)
        # A tight loop into one list, extended onto the message once: this process stands in
        # for an accelerator, and the CPU it spends is taken from the scheduler bench.scale
        # measures on the same cores.
        tokens = []
        handles = self.handles
        for handle in plan.decode_handles:
            held = handles.get(handle)
            if held is None:
                tokens.append(UNHELD_DECODE_TOKEN)
                continue
            held.num_computed += 1
            held.num_tokens += 1
            tokens.append(_token(held))
        result.decode_token_ids.extend(tokens)
        self.tokens += len(result.decode_token_ids) + len(result.outputs)
        if plan.new_requests or plan.continuing_requests or plan.decode_handles:
            time.sleep(max(0.0, started + self.step_s - time.monotonic()))
            finished = time.monotonic()
            self.busy_s += finished - started
            self.steps += 1
            result.forward_time_s = result.step_time_s = finished - started
            self._write_stats(finished)
        if plan.want_held_requests:
            result.held_requests.extend(
                executor_pb2.HeldRequest(request_id=h.request_id, block_ids=h.block_ids, num_computed_tokens=h.num_computed)
                for h in self.requests.values()
            )
        return result

    def _advance(self, held: _Held, num_tokens: int, result: executor_pb2.StepResult) -> None:
        held.num_computed += num_tokens
        output = result.outputs.add(request_id=held.request_id)
        if held.num_computed == held.num_tokens:
            held.num_tokens += 1
            output.token_ids.append(_token(held))

    def _forget(self, request_id: str) -> None:
        held = self.requests.pop(request_id, None)
        if held is not None and self.handles.get(held.handle) is held:
            del self.handles[held.handle]

    def _write_stats(self, now: float) -> None:
        if self.stats_file is None or now - self._written_at < STATS_INTERVAL_S:
            return
        self._written_at = now
        partial = self.stats_file.with_suffix(".partial")
        partial.write_text(json.dumps({"at": now, "busy_s": self.busy_s, "steps": self.steps, "tokens": self.tokens}))
        os.replace(partial, self.stats_file)


def _token(held: _Held) -> int:
    """Any token but EOS, varying with the position."""
    return (held.seed + held.num_tokens * 7919) % (VOCAB_SIZE - 1) + 1


def build(step_s: float, num_kv_blocks: int, block_size: int, max_model_len: int, stats_file: Path | None) -> SimulatedExecutor:
    info = executor_pb2.ExecutorInfo(
        model_id="simulated",
        vocab_size=VOCAB_SIZE,
        eos_token_ids=[EOS_TOKEN_ID],
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        dtype="none",
        device="simulated",
        incarnation_id=uuid.uuid4().hex,
        max_logprobs=0,
        attention_backend="simulated",
        lease_timeout_s=30.0,
        supports_decode_handles=True,
    )
    return SimulatedExecutor(TimedRunner(step_s, stats_file), info)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated time of each step with work")
    parser.add_argument("--num-kv-blocks", type=int, default=100_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--stats-file", type=Path, help="JSON snapshot of busy time, rewritten as steps run")
    parser.add_argument("--executor-token-file", type=Path, help="the shared token schedulers must send")
    parser.add_argument("--insecure-executor", action="store_true", help="take plans from anyone")
    args = parser.parse_args()
    try:
        token = read_token_file(args.executor_token_file) if args.executor_token_file else None
        access = ExecutorAccess.from_flags(token, args.insecure_executor, "", mutual_tls=False)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    executor = build(args.step_ms / 1000, args.num_kv_blocks, args.block_size, args.max_model_len, args.stats_file)
    options = ServeOptions(args.host, args.port, executor.info.lease_timeout_s, access)
    asyncio.run(serve(executor, options, step_thread()))


if __name__ == "__main__":
    main()
