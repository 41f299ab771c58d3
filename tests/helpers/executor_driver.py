"""Drives an executor over gRPC the way a scheduler would, for tests: a block allocator, plans
built from a mirror of each request's progress, and a plan stream that can run ahead of results.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc as pb_grpc

_CLOSE = object()


class PlanStream:
    """One Execute stream; plans may be sent before earlier results are read."""

    def __init__(self, channel: grpc.Channel, holder: str | None = None) -> None:
        """holder: the scheduler identity the stream claims (x-splitserve-scheduler-id)."""
        self._plans: queue.Queue[object] = queue.Queue()
        metadata = (("x-splitserve-scheduler-id", holder),) if holder is not None else None
        self._results = pb_grpc.ExecutorStub(channel).Execute(self._iterate(), metadata=metadata)
        self._step_ids = itertools.count(1)

    def _iterate(self) -> Iterator[pb.StepPlan]:
        while (plan := self._plans.get()) is not _CLOSE:
            yield plan  # type: ignore[misc]

    def send(self, plan: pb.StepPlan) -> None:
        self._plans.put(plan)

    def receive(self) -> pb.StepResult:
        return next(self._results)

    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        self.send(plan)
        return self.receive()

    def plan(self, **fields: object) -> pb.StepResult:
        """Runs a plan of these fields under the next of this stream's own step ids (1, 2, ...;
        not to be mixed with plans that bring theirs)."""
        return self.step(pb.StepPlan(step_id=next(self._step_ids), **fields))

    def close(self) -> None:
        self._plans.put(_CLOSE)
        for _ in self._results:
            pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks))

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"test ran out of blocks: wanted {count}, {len(self._free)} free")
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


@dataclass
class PlannedRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int = 32
    sampling: pb.SamplerConfig = field(default_factory=pb.SamplerConfig)
    # Most tokens computed per step while prefilling; None computes the whole prompt at once.
    chunk_size: int | None = None
    # Blocks whose KV (of the leading tokens) another request already computed.
    cached_blocks: list[int] = field(default_factory=list)
    # Leading blocks left allocated when the request finishes, for others to share.
    keep_blocks: int = 0
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output]

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class Driver:
    """A toy scheduler: every unfinished request is scheduled every step."""

    def __init__(self, stream: PlanStream, block_size: int, allocator: BlockAllocator) -> None:
        self.stream = stream
        self.block_size = block_size
        self.allocator = allocator
        self.step_ids = itertools.count(1)
        self.pending_drops: list[str] = []

    def plan(self, requests: list[PlannedRequest]) -> pb.StepPlan:
        plan = pb.StepPlan(step_id=next(self.step_ids), dropped_request_ids=self.pending_drops)
        self.pending_drops = []
        for req in requests:
            if req.done:
                continue
            if not req.sent:
                self._plan_new(plan, req)
            else:
                self._plan_continuing(plan, req)
        return plan

    def _schedule(self, req: PlannedRequest) -> int:
        remaining = len(req.tokens) - req.num_computed
        return remaining if req.chunk_size is None else min(remaining, req.chunk_size)

    def _grow(self, req: PlannedRequest, end: int) -> list[int]:
        needed = -(-end // self.block_size) - len(req.blocks)
        new = self.allocator.take(max(0, needed))
        req.blocks.extend(new)
        return new

    def _plan_new(self, plan: pb.StepPlan, req: PlannedRequest) -> None:
        req.sent = True
        req.blocks = list(req.cached_blocks)
        req.num_computed = len(req.cached_blocks) * self.block_size
        count = self._schedule(req)
        self._grow(req, req.num_computed + count)
        plan.new_requests.add(
            request_id=req.request_id,
            token_ids=req.tokens,
            block_ids=req.blocks,
            num_computed_tokens=req.num_computed,
            num_scheduled_tokens=count,
            sampling=req.sampling,
        )
        req.num_computed += count

    def _plan_continuing(self, plan: pb.StepPlan, req: PlannedRequest) -> None:
        count = self._schedule(req)
        new_blocks = self._grow(req, req.num_computed + count)
        plan.continuing_requests.add(
            request_id=req.request_id, num_scheduled_tokens=count, new_block_ids=new_blocks
        )
        req.num_computed += count

    def apply(self, result: pb.StepResult, requests: list[PlannedRequest]) -> None:
        assert not result.rejected, result.rejected
        by_id = {r.request_id: r for r in requests}
        for output in result.outputs:
            by_id[output.request_id].output.extend(output.token_ids)
        for req in requests:
            if req.done and req.request_id not in self.pending_drops and req.sent:
                self.finish(req, req.keep_blocks)

    def finish(self, req: PlannedRequest, keep_blocks: int = 0) -> None:
        """Drops the request in the next plan; its first keep_blocks blocks stay allocated."""
        self.pending_drops.append(req.request_id)
        self.allocator.give_back(req.blocks[keep_blocks:])
        req.blocks = req.blocks[:keep_blocks]
        req.sent = False

    def run(self, requests: list[PlannedRequest]) -> None:
        """Lockstep: each plan waits for the previous result (prefill chunks need the sample)."""
        while any(not r.done for r in requests):
            self.apply(self.stream.step(self.plan(requests)), requests)

    def run_logprobs(self, requests: list[PlannedRequest]) -> dict[str, list[tuple[int, float, list[int], list[float]]]]:
        """run(), returning each request's sampled logprobs step by step: (token, its logprob, top
        ids, top logprobs)."""
        found: dict[str, list[tuple[int, float, list[int], list[float]]]] = {r.request_id: [] for r in requests}
        while any(not r.done for r in requests):
            result = self.stream.step(self.plan(requests))
            for output in result.outputs:
                for entry in output.logprobs:
                    found[output.request_id].append(
                        (entry.token_id, entry.logprob, list(entry.top_token_ids), list(entry.top_logprobs))
                    )
            self.apply(result, requests)
        return found

    def preempt(self, req: PlannedRequest) -> None:
        """Drop and recompute: the next plan drops it and resends it as a new request carrying
        prompt + output, computed from scratch in fresh blocks."""
        self.finish(req)

    def run_pipelined(self, requests: list[PlannedRequest]) -> None:
        """Sends every plan (one prefill, then decodes) before reading any result: decode inputs
        are the executor's own samples, so the plans do not depend on the results."""
        steps = max(r.max_new_tokens for r in requests)
        first = pb.StepPlan(step_id=next(self.step_ids))
        for req in requests:
            req.sent = True
            final_len = len(req.prompt) + req.max_new_tokens
            req.blocks = self.allocator.take(-(-final_len // self.block_size))
            first.new_requests.add(
                request_id=req.request_id,
                token_ids=req.prompt,
                block_ids=req.blocks,
                num_scheduled_tokens=len(req.prompt),
                sampling=req.sampling,
            )
        self.stream.send(first)
        for step in range(1, steps):
            plan = pb.StepPlan(step_id=next(self.step_ids))
            for req in requests:
                if step < req.max_new_tokens:
                    plan.continuing_requests.add(request_id=req.request_id, num_scheduled_tokens=1)
            self.stream.send(plan)
        for _ in range(steps):
            self.apply(self.stream.receive(), requests)
