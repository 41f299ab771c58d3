"""Traces through real processes: a request sent with a W3C traceparent continues the caller's
trace in the scheduler, whose spans (the request, its queueing, the steps that advanced it and
each step's executor forward) reach an OTLP collector linked to each other; and the JSON log
format writes one parseable object per line, request ids included."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.trace.v1 import trace_pb2

from clients import Client
from tests.helpers.executor_process import start_executor
from tests.helpers.gateway_process import start_gateway
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess

torch.set_num_threads(1)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
# The same caller, through the OpenAI-compatible gateway's HTTP traceparent header.
HTTP_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
HTTP_SPAN_ID = "b7ad6b7169203331"
MAX_TOKENS = 12


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent, in memory."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[trace_pb2.Span]:
        with self.lock:
            return [span for span in self.spans if span.name == name]


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    collector = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, port
    server.stop(None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("tracing") / "llama", seed=5)


def http_completion(gateway: str, traceparent: str) -> dict[str, object]:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    request = urllib.request.Request(
        f"http://{gateway}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "traceparent": traceparent},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def attributes(span: trace_pb2.Span) -> dict[str, object]:
    values: dict[str, object] = {}
    for attribute in span.attributes:
        kind = attribute.value.WhichOneof("value")
        values[attribute.key] = getattr(attribute.value, kind)
    return values


def test_a_traceparent_is_continued_and_the_spans_arrive_linked(
    collector: tuple[Collector, int], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spans, port = collector
    # Export batches every 100 ms instead of 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with start_executor(model_dir, num_kv_blocks=64) as (executor, _):
        scheduler = SchedulerProcess(
            executor, otlp_traces_endpoint=f"127.0.0.1:{port}", otlp_traces_insecure=True, log_format="json"
        )
        try:
            address = scheduler.wait_ready()
            traceparent = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
            with Client(address, metadata=[("traceparent", traceparent)]) as client:
                result = client.generate(
                    prompt_token_ids=[5, 6, 7, 8], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                    request_id="traced-1",
                )
            with start_gateway(address, served_model_name="tiny") as gateway:
                completion = http_completion(gateway, f"00-{HTTP_TRACE_ID}-{HTTP_SPAN_ID}-01")
            deadline = time.monotonic() + 20
            while len(spans.named("splitserve.generate")) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
            log_lines = scheduler.log_text().splitlines()
        finally:
            scheduler.close()

    by_trace = {span.trace_id.hex(): span for span in spans.named("splitserve.generate")}
    assert set(by_trace) == {TRACE_ID, HTTP_TRACE_ID}
    through_gateway = by_trace[HTTP_TRACE_ID]
    assert through_gateway.parent_span_id.hex() == HTTP_SPAN_ID
    assert attributes(through_gateway)["gen_ai.usage.output_tokens"] == completion["usage"]["completion_tokens"]
    generate = by_trace[TRACE_ID]
    assert generate.trace_id.hex() == TRACE_ID
    assert generate.parent_span_id.hex() == CALLER_SPAN_ID
    assert generate.kind == trace_pb2.Span.SPAN_KIND_SERVER
    facts = attributes(generate)
    assert facts["splitserve.request_id"] == "traced-1"
    assert facts["gen_ai.usage.input_tokens"] == 4
    assert facts["gen_ai.usage.output_tokens"] == MAX_TOKENS == len(result.token_ids)
    [queue] = [span for span in spans.named("splitserve.queue") if span.trace_id == generate.trace_id]
    assert queue.trace_id == generate.trace_id and queue.parent_span_id == generate.span_id
    assert generate.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano
    # Every step that advanced the request links to its span: one per generated token here.
    linked = [
        step for step in spans.named("splitserve.step")
        if any(link.span_id == generate.span_id and link.trace_id == generate.trace_id for link in step.links)
    ]
    assert len(linked) == MAX_TOKENS
    forwards = {span.parent_span_id: span for span in spans.named("splitserve.executor.forward")}
    for step in linked:
        forward = forwards[step.span_id]
        assert forward.trace_id == step.trace_id
        assert step.start_time_unix_nano <= forward.start_time_unix_nano <= forward.end_time_unix_nano
        assert attributes(step)["splitserve.executor"] == executor
    assert all(step.end_time_unix_nano <= generate.end_time_unix_nano for step in linked)

    # --log-format json: every line is one object, the request's own lines carry its id.
    entries = [json.loads(line) for line in log_lines if line.startswith("{")]
    assert len(entries) == len([line for line in log_lines if line.strip()])
    finished = [e for e in entries if e.get("event") == "request_finished"]
    assert finished and finished[0]["request_id"] == "traced-1" and finished[0]["completion_tokens"] == MAX_TOKENS
