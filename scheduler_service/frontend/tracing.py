"""OpenTelemetry traces of requests and steps, exported over OTLP when an endpoint is set.

A request's span continues the caller's trace (W3C `traceparent` and `tracestate` metadata on
Generate) and holds a `queue` span from arrival to first admission. Steps are shared by many
requests, so each is its own span, linked to the spans of the requests it advanced, with the
executor's forward pass as its child. The executor reports durations, not timestamps (its clock
is another machine's), so a step's spans end when its result arrived and start that long before.

Off by default, and then free: the engine holds `NO_TRACING`, whose methods do nothing, and
opentelemetry (the `tracing` extra) is not even imported.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler_service.core.request import Request
from scheduler_service.core.step_plan import StepOutput

if TYPE_CHECKING:
    from scheduler_service.frontend.output_stream import OutputStream

SERVICE_NAME = "splitserve-scheduler"
# The W3C Trace Context metadata keys a caller may send.
TRACE_CONTEXT_KEYS = frozenset({"traceparent", "tracestate"})


class NoTracing:
    enabled = False

    def request_started(self, stream: OutputStream, carrier: Mapping[str, str]) -> None:
        pass

    def request_finished(self, stream: OutputStream) -> None:
        pass

    def step_done(
        self, executor: str, output: StepOutput, requests: Sequence[Request], received_ns: int
    ) -> None:
        pass

    def shutdown(self) -> None:
        pass


NO_TRACING = NoTracing()


class OtelTracing:
    """Spans through an OpenTelemetry tracer provider of the scheduler's own (no global one)."""

    enabled = True

    def __init__(self, provider: Any) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        self._provider = provider
        self._tracer = provider.get_tracer("splitserve.scheduler")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)
        # Requests keep monotonic times; spans take wall-clock nanoseconds.
        self._wall_minus_monotonic_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def exporting_to(cls, endpoint: str, insecure: bool) -> OtelTracing:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
        return cls(provider)

    def request_started(self, stream: OutputStream, carrier: Mapping[str, str]) -> None:
        request = stream.request
        parent = self._propagator.extract(carrier=dict(carrier))
        span = self._tracer.start_span(
            "splitserve.generate",
            context=parent,
            kind=self._server_kind,
            start_time=self._wall_ns(request.arrival_time),
            attributes={
                "splitserve.request_id": request.request_id,
                "gen_ai.operation.name": "text_completion",
                "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                "splitserve.priority": request.priority,
            },
        )
        if request.sampling.max_tokens is not None:
            span.set_attribute("gen_ai.request.max_tokens", request.sampling.max_tokens)
        span.set_attribute("gen_ai.request.temperature", request.sampling.temperature)
        stream.trace_span = span

    def request_finished(self, stream: OutputStream) -> None:
        span = stream.trace_span
        if span is None:
            return
        # The ended span stays on the stream: the step that finished the request links to it
        # after this runs.
        request = stream.request
        from opentelemetry import trace

        if request.first_scheduled_time is not None:
            queue = self._tracer.start_span(
                "splitserve.queue",
                context=trace.set_span_in_context(span),
                start_time=self._wall_ns(request.arrival_time),
            )
            queue.end(end_time=self._wall_ns(request.first_scheduled_time))
        reason = request.finish_reason.value if request.finish_reason else "error"
        span.set_attributes(
            {
                "gen_ai.response.finish_reasons": [reason],
                "gen_ai.usage.output_tokens": request.num_output_tokens,
                "splitserve.cached_prompt_tokens": request.num_cached_tokens,
                "splitserve.preemptions": request.num_preemptions,
            }
        )
        if request.first_token_time is not None:
            span.set_attribute("splitserve.time_to_first_token_s", request.first_token_time - request.arrival_time)
        if stream.error is not None:
            span.set_status(self._error)
        # Now, when its last message is handed to the call: after the step that finished it.
        span.end()

    def step_done(
        self, executor: str, output: StepOutput, requests: Sequence[Request], received_ns: int
    ) -> None:
        """received_ns: when the result arrived (wall clock), the end of the step's spans."""
        from opentelemetry import trace

        end = received_ns
        links = [
            trace.Link(span.get_span_context())
            for request in requests
            if (span := getattr(request.output, "trace_span", None)) is not None
        ]
        step = self._tracer.start_span(
            "splitserve.step",
            start_time=end - int(output.step_time_s * 1e9),
            links=links,
            attributes={
                "splitserve.executor": executor,
                "splitserve.step_id": output.step_id,
                "splitserve.requests": len(requests),
                "splitserve.forward_time_s": output.forward_time_s,
            },
        )
        forward = self._tracer.start_span(
            "splitserve.executor.forward",
            context=trace.set_span_in_context(step),
            start_time=end - int(output.forward_time_s * 1e9),
            attributes={"splitserve.executor": executor},
        )
        if output.failure is not None:
            forward.set_status(self._error)
            forward.set_attribute("splitserve.failure", output.failure)
        forward.end(end_time=end)
        step.end(end_time=end)

    def shutdown(self) -> None:
        self._provider.shutdown()

    def _wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._wall_minus_monotonic_ns


Tracing = NoTracing | OtelTracing
