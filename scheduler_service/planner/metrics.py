"""Prometheus metrics of the scheduler, named like vLLM's (splitserve: instead of vllm:), so its
dashboards map over by the prefix; one scheduler serves one model, so there is no model_name
label. The executors export their own step timings (executor_service/serving/metrics.py)."""

import time
from collections.abc import Callable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scheduler_service.core.request import Request

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
# Drafts accepted in one verify: 0 up to the largest K worth asking for.
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
# Tenants named in metric labels; later ones (x-splitserve-tenant takes any name) count as "(other)",
# so a caller cannot grow the scrape without bound.
MAX_TENANT_LABELS = 100
OTHER_TENANTS = "(other)"
# Executor states as ExecutorStatus names them, one series each.
EXECUTOR_STATES = ("connecting", "up", "draining", "drained", "refused", "down")


class BatchHistogram(Histogram):
    """A Histogram that also takes many observations at once. observe() takes a lock twice per
    value (about a microsecond); the inter-token latency has one value per running request per
    step, so a step's values go in together: one lock per bucket they fall in, one for the sum.
    The buckets are prometheus_client's own (le: the first upper bound not below the value)."""

    def observe_all(self, amounts: Sequence[float]) -> None:
        if not amounts:
            return
        self._raise_if_not_observable()
        values = np.asarray(amounts, dtype=np.float64)
        # side="left": a value equal to a bound counts in that bound's bucket, as observe() does.
        buckets = np.searchsorted(self._upper_bounds, values, side="left")
        counts = np.bincount(buckets, minlength=len(self._upper_bounds))
        self._sum.inc(float(values.sum()))
        for bucket, count in zip(self._buckets, counts.tolist(), strict=True):
            if count:
                bucket.inc(count)


class SchedulerMetrics:
    """Owned by the engine; registered in a registry of its own (no process-global state)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.running = Gauge("splitserve:num_requests_running", "Requests holding KV blocks.", registry=r)
        self.waiting = Gauge("splitserve:num_requests_waiting", "Requests queued.", registry=r)
        self.kv_usage = Gauge("splitserve:kv_cache_usage_perc", "Share of KV blocks in use, 0-1.", registry=r)
        self.executors_up = Gauge("splitserve:executors_up", "Executors answering.", registry=r)
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("splitserve:generation_tokens", "Tokens generated.", registry=r)
        self.prefix_cache_queries = Counter(
            "splitserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "splitserve:prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.preemptions = Counter("splitserve:num_preemptions", "Requests preempted (recomputed).", registry=r)
        self.recomputed_tokens = Counter(
            "splitserve:recomputed_tokens",
            "Tokens computed again because their K/V was lost, by why (preempted, executor_lost, "
            "transfer_failed, released), short of what a prefix hit spared.",
            ["reason"],
            registry=r,
        )
        self.kv_moves = Counter(
            "splitserve:kv_moves", "Requests moved between executors with their K/V, by outcome (ok, failed).",
            ["outcome"], registry=r,
        )
        self.kv_blocks_migrated = Counter(
            "splitserve:kv_blocks_migrated", "KV blocks moved between executors (fetched, or found cached).", registry=r
        )
        self.kv_transfer_bytes = Counter(
            "splitserve:kv_transfer_bytes", "Bytes of K/V fetched by one executor from another.", registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "splitserve:kv_transfer_seconds",
            "Seconds from a destination being told to fetch a request's blocks to their being written.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.finished = Counter(
            "splitserve:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "splitserve:time_to_first_token_seconds", "Arrival to first token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.inter_token = BatchHistogram(
            "splitserve:inter_token_latency_seconds",
            "Time between two deliveries of tokens to a request.",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "splitserve:e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "splitserve:request_queue_time_seconds", "Arrival to first admission.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.request_prompt_tokens = Histogram(
            "splitserve:request_prompt_tokens", "Prompt length of finished requests.", buckets=LENGTH_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "splitserve:request_generation_tokens", "Output length of finished requests.", buckets=LENGTH_BUCKETS, registry=r
        )
        self.executor_state = Gauge(
            "splitserve:executor_state",
            "1 for each executor's current state (connecting, up, draining, drained, refused, down).",
            ["executor", "state"],
            registry=r,
        )
        self.executor_requests = Gauge(
            "splitserve:executor_num_requests", "Requests placed on each executor.", ["executor"], registry=r
        )
        self.executor_kv_usage = Gauge(
            "splitserve:executor_kv_cache_usage_perc", "Share of each executor's KV blocks in use.", ["executor"], registry=r
        )
        # Each executor's children of the two gauges above, set after every step it takes:
        # labels() takes a lock and builds its key on every call.
        self._executor_gauges: dict[str, tuple[Gauge, Gauge]] = {}
        self.tenant_prompt_tokens = Counter(
            "splitserve:tenant_prompt_tokens",
            "Prompt tokens computed (not found in the prefix cache) for each tenant's finished requests.",
            ["tenant"], registry=r,
        )
        self.tenant_generation_tokens = Counter(
            "splitserve:tenant_generation_tokens", "Tokens generated for each tenant's finished requests.",
            ["tenant"], registry=r,
        )
        self.tenant_queue_time = Histogram(
            "splitserve:tenant_request_queue_time_seconds", "Arrival to first admission, by tenant.",
            ["tenant"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.tenant_slo = Counter(
            "splitserve:tenant_slo",
            "Finished requests that carried a target, by tenant, target (ttft: ttft_deadline_ms, "
            "tpot: tpot_target_ms) and outcome (met, missed).",
            ["tenant", "slo", "outcome"], registry=r,
        )
        self.tenant_refused = Counter(
            "splitserve:tenant_requests_refused",
            "Requests refused at arrival, by tenant and reason (max_waiting, tokens_per_minute, "
            "deadline, tpot).",
            ["tenant", "reason"], registry=r,
        )
        self._tenant_labels: set[str] = set()
        # Speculative decoding (core/speculation.py), by proposer.
        self.spec_draft_tokens = Counter(
            "splitserve:spec_draft_tokens", "Draft tokens verified, by proposer (ngram, suffix).", ["method"], registry=r
        )
        self.spec_accepted_tokens = Counter(
            "splitserve:spec_accepted_tokens", "Draft tokens the executor accepted, by proposer.", ["method"], registry=r
        )
        self.spec_accepted_per_verify = Histogram(
            "splitserve:spec_accepted_tokens_per_verify",
            "Drafts accepted in each verified request step, by proposer: _sum / _count is the mean "
            "accepted length (the step yields one token more).",
            ["method"], buckets=ACCEPTED_BUCKETS, registry=r,
        )

    def tenant_label(self, tenant: str) -> str:
        if tenant in self._tenant_labels:
            return tenant
        if len(self._tenant_labels) >= MAX_TENANT_LABELS:
            return OTHER_TENANTS
        self._tenant_labels.add(tenant)
        return tenant

    def request_refused(self, tenant: str, reason: str) -> None:
        self.tenant_refused.labels(self.tenant_label(tenant), reason).inc()

    def request_finished(self, request: Request) -> None:
        reason = request.finish_reason.value if request.finish_reason else "abort"
        self.finished.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.prefix_cache_queries.inc(request.num_prompt_tokens)
        self.prefix_cache_hits.inc(request.num_cached_tokens)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_output_tokens)
        arrival = request.arrival_time
        if request.first_scheduled_time is not None:
            self.queue_time.observe(request.first_scheduled_time - arrival)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - arrival)
        if request.finish_time is not None:
            self.e2e.observe(request.finish_time - arrival)
        self._tenant_finished(request)

    def _tenant_finished(self, request: Request) -> None:
        tenant = self.tenant_label(request.tenant)
        self.tenant_prompt_tokens.labels(tenant).inc(max(0, request.num_prompt_tokens - request.num_cached_tokens))
        self.tenant_generation_tokens.labels(tenant).inc(request.num_output_tokens)
        arrival, first = request.arrival_time, request.first_token_time
        if request.first_scheduled_time is not None:
            self.tenant_queue_time.labels(tenant).observe(request.first_scheduled_time - arrival)
        if request.ttft_deadline_s and not (first is None and request.num_output_tokens):
            # Judged where its first token came (a request submitted again after its planner was
            # lost had it there); one ended without a token missed only if it waited past it.
            if first is not None:
                met: bool | None = first - arrival <= request.ttft_deadline_s
            else:
                ended = request.finish_time if request.finish_time is not None else time.monotonic()
                met = False if ended - arrival > request.ttft_deadline_s else None
            if met is not None:
                self.tenant_slo.labels(tenant, "ttft", "met" if met else "missed").inc()
        if request.tpot_target_s and first is not None and request.finish_time is not None and request.num_output_tokens > 1:
            per_token = (request.finish_time - first) / (request.num_output_tokens - 1)
            self.tenant_slo.labels(tenant, "tpot", "met" if per_token <= request.tpot_target_s else "missed").inc()

    def drafts_verified(self, method: str, verified: Sequence[tuple[str, int, int]]) -> None:
        """A step's verified entries: (request id, drafts, accepted) each."""
        histogram = self.spec_accepted_per_verify.labels(method)
        for _, _, accepted in verified:
            histogram.observe(accepted)
        self.spec_draft_tokens.labels(method).inc(sum(drafts for _, drafts, _ in verified))
        self.spec_accepted_tokens.labels(method).inc(sum(accepted for _, _, accepted in verified))

    def count_when_scraped(
        self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float]
    ) -> None:
        """The totals over every executor, read when a scrape asks rather than set after every
        step of any executor (a sum over the executors each time: at 16 executors stepping every
        20 ms, ~30 us of each step). The scrape calls them from its own thread."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)

    def executor_stepped(self, address: str, num_requests: int, kv_usage: float) -> None:
        gauges = self._executor_gauges.get(address)
        if gauges is None:
            gauges = self._executor_gauges[address] = (
                self.executor_requests.labels(executor=address),
                self.executor_kv_usage.labels(executor=address),
            )
        gauges[0].set(num_requests)
        gauges[1].set(kv_usage)

    def executor_changed(self, address: str, state: str) -> None:
        for name in EXECUTOR_STATES:
            self.executor_state.labels(executor=address, state=name).set(1.0 if name == state else 0.0)

    def executor_removed(self, address: str) -> None:
        for name in EXECUTOR_STATES:
            self.executor_state.remove(address, name)
        self._executor_gauges.pop(address, None)
        for gauge in (self.executor_requests, self.executor_kv_usage):
            try:
                gauge.remove(address)
            except KeyError:
                pass
