"""Prometheus metrics of one executor: what each step cost and carried, and its KV use.

Named like the scheduler's (splitserve:executor_...), in a registry of the executor's own. Steps
are observed on the worker thread that ran them; the blocks in use are counted there too, at
most once a second, because counting walks every request's block table.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protos.splitserve.executor.v1 import executor_pb2

TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
KV_COUNT_INTERVAL_S = 1.0


class ExecutorMetrics:
    def __init__(
        self,
        num_kv_blocks: int,
        blocks_in_use: Callable[[], int],
        registry: CollectorRegistry | None = None,
        graphed_steps: Callable[[], int] = lambda: 0,
        num_state_slots: int = 0,
        slots_in_use: Callable[[], tuple[int, int]] = lambda: (0, 0),
        computed_tokens: Callable[[], tuple[int, int]] = lambda: (0, 0),
        num_host_blocks: int = 0,
        swapped_blocks: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        """graphed_steps: how many steps so far replayed a CUDA graph (decode_graphs.py).
        num_state_slots, slots_in_use: a model with recurrent layers' state slots, and how many
        requests and checkpoints hold one. computed_tokens: prompt and decode tokens computed so
        far (the runner counts them, as only it knows where each request's prompt ends).
        num_host_blocks, swapped_blocks: the host tier's blocks, and how many were copied so far
        out of the device and back in (the runner counts them, as only it knows which swaps ran)."""
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._blocks_in_use = blocks_in_use
        self._graphed_steps = graphed_steps
        self._slots_in_use = slots_in_use
        self._computed_tokens = computed_tokens
        self._computed_seen = (0, 0)
        self._swapped_blocks = swapped_blocks
        self._swapped_seen = (0, 0)
        self._graphed_seen = 0
        self._counted_at = 0.0
        self.forward_time = Histogram(
            "splitserve:executor_forward_time_seconds",
            "Seconds per step in the model forward pass and sampling.",
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "splitserve:executor_step_time_seconds",
            "Seconds per step from taking the plan to answering it (input building included).",
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            "splitserve:executor_step_tokens", "Tokens computed per step.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.step_requests = Histogram(
            "splitserve:executor_step_requests", "Requests advanced per step.", buckets=REQUEST_BUCKETS, registry=r
        )
        self.steps = Counter("splitserve:executor_steps", "Steps run (plans with work).", registry=r)
        self.step_failures = Counter(
            "splitserve:executor_step_failures", "Steps whose forward pass raised.", registry=r
        )
        self.graphed = Counter(
            "splitserve:executor_graphed_steps", "Steps whose forward replayed a CUDA graph.", registry=r
        )
        self.kv_blocks_total = Gauge(
            "splitserve:executor_kv_blocks_total", "KV cache blocks this executor holds.", registry=r
        )
        self.kv_blocks_in_use = Gauge(
            "splitserve:executor_kv_blocks_in_use",
            "KV cache blocks in the block tables of the requests this executor holds.",
            registry=r,
        )
        self.kv_blocks_total.set(num_kv_blocks)
        self.state_slots_total = Gauge(
            "splitserve:executor_state_slots_total",
            "Recurrent-state slots this executor holds (0: its model has no recurrent layers).",
            registry=r,
        )
        self.state_slots_in_use = Gauge(
            "splitserve:executor_state_slots_in_use",
            "Recurrent-state slots holding a running request's state (held) or a prefix checkpoint.",
            ["holder"],
            registry=r,
        )
        self.state_slots_total.set(num_state_slots)
        self.computed_tokens = Counter(
            "splitserve:executor_computed_tokens",
            "Tokens computed by steps that did not fail: prompt (positions inside the request's "
            "prompt) or decode.",
            ["kind"],
            registry=r,
        )
        self.kv_host_blocks_total = Gauge(
            "splitserve:executor_kv_host_blocks_total",
            "KV blocks of this executor's host tier (--kv-host-gib; 0: no tier).",
            registry=r,
        )
        self.kv_host_blocks_total.set(num_host_blocks)
        self.kv_swapped_blocks = Counter(
            "splitserve:executor_kv_swapped_blocks",
            "KV blocks copied out of the device into the host tier (out) or back (in).",
            ["direction"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "splitserve:executor_kv_transfer_bytes",
            "Bytes of K/V sent to other executors (KvTransfer.FetchBlocks) or received from them.",
            ["direction"],
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "splitserve:executor_kv_transfer_seconds",
            "Seconds from the plan that asked for an import to its blocks being written.",
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.kv_imports = Counter(
            "splitserve:executor_kv_imports", "Imports of K/V blocks that ended, by outcome.", ["outcome"], registry=r
        )
        # Every series shows from the start, at 0, so a rate over a window reads it.
        for kind in ("prompt", "decode"):
            self.computed_tokens.labels(kind)
        for direction in ("sent", "received"):
            self.kv_transfer_bytes.labels(direction)
        for direction in ("out", "in"):
            self.kv_swapped_blocks.labels(direction)
        for outcome in ("ok", "failed"):
            self.kv_imports.labels(outcome)

    def observe_import(self, result: executor_pb2.KvImportResult) -> None:
        """An import that ended (StepResult.kv_imports_done)."""
        self.kv_imports.labels("ok" if result.ok else "failed").inc()
        if result.ok:
            self.kv_transfer_seconds.observe(result.seconds)

    def observe_step(self, plan: executor_pb2.StepPlan, result: executor_pb2.StepResult) -> None:
        """On the worker thread, after the plan ran."""
        tokens = (
            sum(entry.num_scheduled_tokens for entry in plan.new_requests)
            + sum(entry.num_scheduled_tokens for entry in plan.continuing_requests)
            + len(plan.decode_handles)
        )
        if tokens:
            self.steps.inc()
            self.forward_time.observe(result.forward_time_s)
            self.step_time.observe(result.step_time_s)
            self.step_tokens.observe(tokens)
            self.step_requests.observe(
                len(plan.new_requests) + len(plan.continuing_requests) + len(plan.decode_handles)
            )
        if result.HasField("failure"):
            self.step_failures.inc()
        graphed = self._graphed_steps()
        self.graphed.inc(graphed - self._graphed_seen)
        self._graphed_seen = graphed
        computed = self._computed_tokens()
        for kind, now_count, seen in zip(("prompt", "decode"), computed, self._computed_seen, strict=True):
            if now_count > seen:
                self.computed_tokens.labels(kind).inc(now_count - seen)
        self._computed_seen = computed
        swapped = self._swapped_blocks()
        for direction, now_count, seen in zip(("out", "in"), swapped, self._swapped_seen, strict=True):
            if now_count > seen:
                self.kv_swapped_blocks.labels(direction).inc(now_count - seen)
        self._swapped_seen = swapped
        now = time.monotonic()
        # Counted when requests come or go, and at least once a second as they grow: a request
        # that comes and goes within a second still shows.
        if plan.new_requests or plan.dropped_request_ids or now - self._counted_at >= KV_COUNT_INTERVAL_S:
            self._counted_at = now
            self.kv_blocks_in_use.set(self._blocks_in_use())
            held, checkpoints = self._slots_in_use()
            self.state_slots_in_use.labels("request").set(held)
            self.state_slots_in_use.labels("checkpoint").set(checkpoints)
