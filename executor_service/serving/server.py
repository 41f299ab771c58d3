"""The Executor gRPC service (grpc.aio), with the standard health and reflection services."""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_service.runner.late_bitmasks import LateBitmasks
from executor_service.serving.access import ExecutorAccess
from executor_service.serving.kv_fetch import KvFetcher, peer_certificate_problem
from executor_service.serving.kv_moves import BlockAccess, KvMoves, StateAccess
from executor_service.serving.kv_transfer import KV_TRANSFER_SERVICE, KvTransferServicer
from executor_service.serving.metrics import ExecutorMetrics
from executor_service.serving.settings import DEFAULT_DRAIN_TIMEOUT_S
from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.executor.v1 import executor_pb2, executor_pb2_grpc
from service_support.health_port import start_health_port
from service_support.metrics_port import serve_metrics
from service_support.transport_security import (
    ClientTls,
    ServerTls,
    peer_certificate_name,
)

logger = logging.getLogger(__name__)


class StepRunner(Protocol):
    """Runs plans, one at a time, on the worker thread (executor_service.runner.model_runner, or a
    benchmark's simulated runner)."""

    def execute(self, plan: executor_pb2.StepPlan, late: LateBitmasks) -> executor_pb2.StepResult:
        """late: where the bitmasks that follow the plan (bitmask_follows) come from."""
        ...

    def drop_all_requests(self, wipe_kv: bool = False) -> None:
        """Forgets every request; wipe_kv also zeroes every block's K/V (a new holder must not
        read what the last one computed)."""
        ...

    def num_kv_blocks_in_use(self) -> int:
        """Distinct blocks in the block tables of the requests held (worker thread only)."""
        ...

    def graphed_steps(self) -> int:
        """Steps so far whose forward replayed a CUDA graph (worker thread only)."""
        ...

    def state_slots_in_use(self) -> tuple[int, int]:
        """Recurrent-state slots held by requests, and holding checkpoints (worker thread only)."""
        ...

    def computed_tokens(self) -> tuple[int, int]:
        """Prompt and decode tokens computed so far by steps that did not fail (worker thread only)."""
        ...

    def swapped_blocks(self) -> tuple[int, int]:
        """Blocks copied so far out of the device into the host tier, and back in (worker thread only)."""
        ...

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """These blocks' K/V as KvBlockChunk.data carries them (worker thread only; called only
        where ExecutorInfo.supports_kv_transfer is on)."""
        ...

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        """read_blocks' bytes of as many blocks, written into these (worker thread only; called
        only where ExecutorInfo.supports_kv_transfer is on)."""
        ...

    def read_state(self, slot: int) -> bytes:
        """One recurrent-state slot as KvBlockChunk.state carries it (worker thread only; called
        only where supports_kv_transfer is on and the model has recurrent layers)."""
        ...

    def write_state(self, slot: int, data: bytes) -> None:
        """read_state's bytes, written into a slot no request holds; ValueError, writing nothing,
        where they cannot be (worker thread only; called as read_state is)."""
        ...


class ServedExecutor(Protocol):
    """What the service serves: a runner and the ExecutorInfo that describes it (startup's
    ReadyExecutor). Kept a protocol so this module needs no torch."""

    @property
    def runner(self) -> StepRunner: ...

    @property
    def info(self) -> executor_pb2.ExecutorInfo: ...

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
# Metadata key of the identity a scheduler presents on Execute (the scheduler's ExecutorLink
# sends it under the same name).
SCHEDULER_ID_METADATA = "x-splitserve-scheduler-id"
# Pings from schedulers (every 10 s) are welcome, with or without calls; the executor pings an
# idle scheduler connection too, so a frozen scheduler's stream ends and releases its hold (in
# about 20 s, not when the lease lapses). ping_timeout_ms is what bounds the answer: grpcio times
# every ping by it (default 60 s); see the scheduler's executor_link.KEEPALIVE_OPTIONS.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# Seconds in-flight calls get to finish once the drain is over.
SHUTDOWN_GRACE_S = 5.0
DRAINING_MESSAGE = "this executor is shutting down and takes no new plan streams"
MALFORMED_PLAN_MESSAGE = "a message on the plan stream could not be parsed as a StepPlan"


@dataclass(slots=True, frozen=True)
class _StreamError:
    code: grpc.StatusCode
    message: str


_SUPERSEDED = _StreamError(grpc.StatusCode.ABORTED, "superseded by a newer Execute stream")
_STEP_FAILED = _StreamError(grpc.StatusCode.INTERNAL, "the executor failed a step")

_Pending = asyncio.Queue[asyncio.Future[executor_pb2.StepResult | None] | _StreamError | None]


@dataclass(slots=True)
class _Stream:
    """One Execute call: its plans on their way through the worker, and why it ended early."""

    number: int
    # The scheduler that opened it: the metadata x-splitserve-scheduler-id ("" when none was
    # sent), after its certificate's common name and a slash under mutual TLS.
    holder: str
    # When it last sent a plan (monotonic seconds): its hold lapses lease_timeout_s later.
    last_plan_at: float = field(default_factory=time.monotonic)
    pending: _Pending = field(default_factory=asyncio.Queue)
    ending: _StreamError | None = None
    # The worker thread's view of `ending`: plans of an ended stream still queued are skipped.
    skip_plans: threading.Event = field(default_factory=threading.Event)
    # Bitmasks sent after their plans (StepPlan.bitmasks_for_step), for the steps waiting on them.
    late: LateBitmasks = field(default_factory=LateBitmasks)

    def end(self, error: _StreamError) -> None:
        if self.ending is None:
            self.ending = error
        self.skip_plans.set()
        self.late.close()
        # Wakes the call if it waits for a plan.
        self.pending.put_nowait(error)


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Only callers the access policy admits get anything (executor_service/serving/access.py).
    Request state lives in the runner and belongs to one scheduler at a time. The active stream's
    scheduler holds the executor: a stream from another scheduler is refused with
    FAILED_PRECONDITION until the holder's stream ends or it sends no plan for lease_timeout_s,
    while a new stream from the holder itself supersedes its old one (a reconnect). Every new
    stream starts from no request state, and one from another holder than the last also from
    zeroed K/V: a plan can name any block, and must not read another scheduler's prompts back.
    One worker thread runs all plans in arrival order, which keeps the event loop free for
    Describe and health checks."""

    def __init__(
        self,
        executor: ServedExecutor,
        worker: ThreadPoolExecutor,
        lease_timeout_s: float,
        metrics: ExecutorMetrics,
        access: ExecutorAccess,
        moves: KvMoves,
    ) -> None:
        self._executor = executor
        self._moves = moves
        self._worker = worker
        self._lease_timeout_s = lease_timeout_s
        self._metrics = metrics
        self._access = access
        self._active: _Stream | None = None
        # Who held the executor last, stream ended or not: the K/V in its blocks is theirs.
        self._last_holder: str | None = None
        self._stream_numbers = itertools.count(1)
        # Set by SIGTERM: results tell the holder, and no new stream is taken.
        self.draining = False
        # Set whenever no stream is active, so a drain can wait for the holder's to end.
        self.no_stream = asyncio.Event()
        self.no_stream.set()

    async def Describe(
        self, request: executor_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ExecutorInfo:
        await self._admit(context, "Describe")
        return self._executor.info

    async def _admit(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """Ends the call unless the access policy admits its caller."""
        refusal = self._access.refusal(context)
        if refusal is not None:
            logger.warning(
                "event=call_refused method=%s peer=%s code=%s", method, context.peer(), refusal.code.name
            )
            await context.abort(refusal.code, refusal.message)

    async def Execute(
        self,
        request_iterator: AsyncIterator[executor_pb2.StepPlan],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[executor_pb2.StepResult]:
        await self._admit(context, "Execute")
        # The metadata is only a claim, trusted where nothing stronger is configured (the token
        # admits; it names no one). Under mutual TLS the certificate's name comes first, so no
        # claim crosses from one certificate to another; the claim still follows it, since
        # replicas of one scheduler share a certificate and one must wait for the other's lease
        # rather than supersede its stream.
        claimed = dict(context.invocation_metadata() or ()).get(SCHEDULER_ID_METADATA, "")
        certificate_name = peer_certificate_name(context)
        holder = claimed if certificate_name is None else f"{certificate_name}/{claimed}"
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        refusal = self._refusal(holder)
        if refusal is not None:
            # The log names both; the caller learns only that someone else holds it: the holder's
            # identity, sent back, was once all it took to take an executor over.
            logger.warning(
                "event=stream_refused holder=%r active_holder=%r peer=%s",
                holder, self._active.holder if self._active else "", context.peer(),
            )
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        stream = self._open_stream(context.peer(), holder)
        reader = asyncio.create_task(self._read_plans(request_iterator, stream, context.peer()))
        try:
            while (item := await stream.pending.get()) is not None:
                if stream.ending is not None or isinstance(item, _StreamError):
                    break
                try:
                    result = await item
                except Exception:
                    # The runner logged it and dropped every request.
                    stream.end(_STEP_FAILED)
                    break
                if result is None or stream.ending is not None:
                    break
                result.draining = self.draining
                yield result
            if stream.ending is not None:
                await context.abort(stream.ending.code, stream.ending.message)
        finally:
            reader.cancel()
            if self._active is stream:
                self._active = None
                self.no_stream.set()

    def _refusal(self, holder: str) -> str | None:
        """Why a stream from `holder` may not take the executor now, or None."""
        active = self._active
        if active is None or active.holder == holder:
            return None
        idle_s = time.monotonic() - active.last_plan_at
        if idle_s >= self._lease_timeout_s:
            return None
        return (
            f"this executor is held by another scheduler (its hold lapses after "
            f"{self._lease_timeout_s:g} s without plans or when its stream ends)"
        )

    def _open_stream(self, peer: str, holder: str) -> _Stream:
        """Makes a new stream the active one, ending the one it supersedes: the scheduler that
        opens a stream starts over and resends every request it wants run."""
        stream = _Stream(number=next(self._stream_numbers), holder=holder)
        previous, self._active = self._active, stream
        self.no_stream.clear()
        if previous is not None:
            previous.end(_SUPERSEDED)
            logger.info(
                "event=stream_superseded old_stream=%d old_holder=%r new_stream=%d holder=%r peer=%s",
                previous.number,
                previous.holder,
                stream.number,
                holder,
                peer,
            )
        else:
            logger.info("event=stream_opened stream=%d holder=%r peer=%s", stream.number, holder, peer)
        wipe = self._last_holder is not None and self._last_holder != holder
        if wipe:
            logger.info("event=kv_wiped reason=holder_changed stream=%d holder=%r", stream.number, holder)
        self._last_holder = holder
        # Submitted before any plan of the new stream, so it runs after a superseded stream's
        # plan that may be mid-forward and before the new stream's first plan.
        self._worker.submit(self._start_over, wipe)
        return stream

    def _start_over(self, wipe_kv: bool) -> None:
        """On the worker thread: no request, offer or import of an earlier stream is kept."""
        self._moves.drop_all()
        self._executor.runner.drop_all_requests(wipe_kv)

    def _run_plan(
        self, stream: _Stream, plan: executor_pb2.StepPlan
    ) -> executor_pb2.StepResult | None:
        """On the worker thread. None for a plan of a stream that ended while it was queued."""
        if stream.skip_plans.is_set():
            return None
        imports_done = self._moves.before_plan(plan)
        result = self._executor.runner.execute(plan, stream.late)
        result.kv_imports_done.extend(imports_done)
        self._metrics.observe_step(plan, result)
        return result

    async def _read_plans(
        self, plans: AsyncIterator[executor_pb2.StepPlan], stream: _Stream, peer: str
    ) -> None:
        """Hands each plan to the worker as soon as it arrives, so plan N+1 queues behind plan N
        instead of waiting for result N to be sent."""
        loop = asyncio.get_running_loop()
        last_step: int | None = None
        try:
            async for plan in plans:
                if stream.ending is not None:
                    return
                if plan.bitmasks_for_step:
                    # Not a plan: bitmasks for one already queued or running.
                    stream.last_plan_at = time.monotonic()
                    late = {entry.request_id: entry.allowed_token_bitmask for entry in plan.late_bitmasks}
                    stream.late.put(plan.bitmasks_for_step, late)
                    continue
                if last_step is not None and plan.step_id <= last_step:
                    message = f"step_id {plan.step_id} does not increase past {last_step}"
                    logger.warning("event=stream_rejected problem=%r", message)
                    stream.end(_StreamError(grpc.StatusCode.INVALID_ARGUMENT, message))
                    return
                last_step = plan.step_id
                stream.last_plan_at = time.monotonic()
                await stream.pending.put(
                    loop.run_in_executor(self._worker, self._run_plan, stream, plan)
                )
        except DecodeError as error:
            # grpc.aio raises the StepPlan parser's error from the request iterator; uncaught, it
            # ended this task silently and the stream with status OK.
            logger.warning("event=plan_malformed peer=%s reason=%r", peer, str(error))
            stream.end(_StreamError(grpc.StatusCode.INVALID_ARGUMENT, f"{MALFORMED_PLAN_MESSAGE}: {error}"))
        except grpc.RpcError as error:
            # The caller went away mid-stream; the plans it did send still run in order.
            logger.info("event=stream_broken error=%r", error)
        finally:
            # No more bitmasks can come: a step waiting for some fails rather than hangs.
            stream.late.close()
            await stream.pending.put(None)


@dataclass(slots=True, frozen=True)
class ServeOptions:
    host: str
    port: int
    lease_timeout_s: float
    # Who may call the Executor API; no default, so every way of serving decides.
    access: ExecutorAccess
    # TLS on the executor API; with a client CA only schedulers holding a certificate it signed
    # may call (mutual TLS), and a plain client cannot even complete the handshake.
    tls: ServerTls | None = None
    # How this executor calls other executors to fetch K/V (kv_fetch.peer_tls): under mutual TLS
    # a certificate that allows clientAuth, which a serverAuth-only server certificate does not.
    # None fetches in plaintext, which TLS peers refuse: set it wherever tls is set.
    peer_tls: ClientTls | None = None
    # Plaintext port serving only grpc.health.v1, for probes that cannot do (mutual) TLS.
    health_port: int | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # Prometheus metrics over HTTP on this port (off when None).
    metrics_port: int | None = None


def step_thread() -> ThreadPoolExecutor:
    """The one thread that runs torch in this process: build the model on it (startup's
    packing and self-check run parallel regions), then hand it to serve for every plan.

    libgomp keeps a team of worker threads per thread that starts parallel regions. A model
    built on the main thread and stepped on another makes two teams, more OpenMP threads than
    cores on a machine sized to --threads, and libgomp then cuts its busy-wait between regions
    from 300,000 spins to 100: the workers sleep between the many short regions of a decode
    step and each region waits for a wake-up. Random Llama, 2 threads, decode step in process:
    27.5 ms on one thread, 32.8-41.9 ms built on one and stepped on another; served, the mean
    decode forward went from 31.9-34.2 to 29.6-31.8 ms."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")


async def serve(executor: ServedExecutor, options: ServeOptions, worker: ThreadPoolExecutor) -> None:
    """Serves until SIGTERM or SIGINT, then drains (health NOT_SERVING, new plan streams
    refused, the holder told by its results so it finishes what runs here and ends its stream)
    and stops. worker: the step_thread() the executor was built on; every plan runs there."""
    host, port = options.host, options.port
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A second copy on a taken port must fail to bind, not silently share it.
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_OPTIONS,
        ]
    )
    runner = executor.runner
    metrics = ExecutorMetrics(
        executor.info.num_kv_blocks,
        runner.num_kv_blocks_in_use,
        graphed_steps=runner.graphed_steps,
        num_state_slots=executor.info.num_state_slots,
        slots_in_use=runner.state_slots_in_use,
        computed_tokens=runner.computed_tokens,
        num_host_blocks=executor.info.num_host_blocks,
        swapped_blocks=runner.swapped_blocks,
    )
    # Describe tells schedulers (and their status) who may drive this executor.
    executor.info.access = options.access.mode
    info = executor.info
    # One rank's whole cache (an executor that moves K/V is never sharded), over its blocks.
    block_bytes = info.kv_cache_bytes // max(1, info.num_kv_blocks)
    fetcher = _kv_fetcher(info, block_bytes, options, metrics)
    state = StateAccess(runner.read_state, runner.write_state, info.num_state_slots) if info.num_state_slots else None
    blocks = BlockAccess(runner.read_blocks, runner.write_blocks, info.kv_layout, block_bytes, info.num_kv_blocks, state)
    moves = KvMoves(blocks, fetcher, asyncio.get_running_loop(), metrics)
    servicer = ExecutorServicer(executor, worker, options.lease_timeout_s, metrics, options.access, moves)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    executor_pb2_grpc.add_KvTransferServicer_to_server(
        KvTransferServicer(moves, worker, options.access, metrics), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, KV_TRANSFER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    if options.tls is None:
        bound_port = server.add_insecure_port(address)
    else:
        bound_port = server.add_secure_port(address, options.tls.credentials())
    if bound_port == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    await server.start()
    health_server = None
    if options.health_port is not None:
        health_server, bound_health = await start_health_port(health_servicer, host, options.health_port)
        logger.info("event=health_port_listening address=%s:%d", host, bound_health)
    metrics_port = serve_metrics(options.metrics_port, host, metrics.registry)
    if metrics_port is not None:
        logger.info("event=metrics_listening address=%s:%d", host, metrics_port)
    for service in ("", SERVICE_NAME, KV_TRANSFER_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info(
        "event=executor_ready address=%s:%d port=%d metrics_port=%s model=%s device=%s dtype=%s "
        "blocks=%d block_size=%d backend=%s incarnation=%s tls=%s access=%s",
        host,
        bound_port,
        bound_port,
        metrics_port if metrics_port is not None else "off",
        info.model_id,
        info.device,
        info.dtype,
        info.num_kv_blocks,
        info.block_size,
        info.attention_backend,
        info.incarnation_id,
        "off" if options.tls is None else "mutual" if options.tls.mutual else "server",
        options.access.mode,
    )
    if options.access.insecure:
        logger.warning(
            "event=executor_insecure address=%s:%d advice='anyone who reaches this port can run "
            "plans and read the K/V of other requests: use --executor-token-file or mutual TLS'",
            host, bound_port,
        )
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await drain(servicer, options.drain_timeout_s)
    await server.stop(SHUTDOWN_GRACE_S)
    if health_server is not None:
        await health_server.stop(None)
    # Imports still fetching are abandoned (their scheduler recomputes), before their channels close.
    await loop.run_in_executor(worker, moves.drop_all)
    if fetcher is not None:
        await fetcher.close()
    worker.shutdown(wait=True, cancel_futures=True)
    logger.info("event=executor_stopped")


def _kv_fetcher(
    info: executor_pb2.ExecutorInfo, block_bytes: int, options: ServeOptions, metrics: ExecutorMetrics
) -> KvFetcher | None:
    """How this executor fetches other executors' blocks, with its own credentials; None where it
    moves no K/V."""
    if not info.supports_kv_transfer:
        return None
    problem = peer_certificate_problem(options.tls, options.peer_tls)
    if problem is not None:
        logger.warning("event=executor_peer_tls_unusable reason=%r", problem)
    return KvFetcher(
        info.kv_layout,
        block_bytes,
        options.access.token,
        options.peer_tls,
        metrics.kv_transfer_bytes.labels("received").inc,
    )


async def drain(servicer: ExecutorServicer, timeout_s: float) -> None:
    """Waits until the holder's stream ends (its scheduler saw `draining` on a result, moved its
    queued requests elsewhere and let the running ones finish) or timeout_s passes."""
    servicer.draining = True
    logger.info("event=executor_draining holder_stream=%s timeout_s=%.1f", not servicer.no_stream.is_set(), timeout_s)
    try:
        await asyncio.wait_for(servicer.no_stream.wait(), timeout_s)
        logger.info("event=executor_drained")
    except TimeoutError:
        logger.warning("event=executor_drain_timed_out timeout_s=%.1f", timeout_s)
