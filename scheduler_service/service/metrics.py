"""Prometheus metrics of the scheduler, named like vLLM's (splitserve: instead of vllm:)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scheduler_service.core.request import Request

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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
        self.prefix_cache_hits = Counter("splitserve:prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=r)
        self.preemptions = Counter("splitserve:num_preemptions", "Requests preempted (recomputed).", registry=r)
        self.finished = Counter(
            "splitserve:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "splitserve:time_to_first_token_seconds", "Arrival to first token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "splitserve:e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "splitserve:request_queue_time_seconds", "Arrival to first admission.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.step_time = Histogram(
            "splitserve:executor_step_seconds",
            "Executor time per step, from taking the plan to answering it.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forward_time = Histogram(
            "splitserve:executor_forward_seconds",
            "Executor time per step in the forward pass and sampling.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def request_finished(self, request: Request) -> None:
        reason = request.finish_reason.value if request.finish_reason else "abort"
        self.finished.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.prefix_cache_hits.inc(request.num_cached_tokens)
        arrival = request.arrival_time
        if request.first_scheduled_time is not None:
            self.queue_time.observe(request.first_scheduled_time - arrival)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - arrival)
        if request.finish_time is not None:
            self.e2e.observe(request.finish_time - arrival)
