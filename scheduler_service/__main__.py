"""Command line: python -m scheduler_service [--port PORT] [--executor HOST:PORT ...] [options].

What a user can get wrong at start (a port, the tokenizer, a TLS file, a flag's value) is
refused in one line and exit status 2 before anything serves; -v adds the traceback."""

import argparse
import logging
import sys
from pathlib import Path

from scheduler_service.core.config import (
    DEFAULT_SPECULATIVE_MAX_BATCH,
    SPECULATIVE_METHODS,
)
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.core.router import DEFAULT_TOKENS_PER_REQUEST
from scheduler_service.core.sampling_params import SamplingDefaults
from scheduler_service.core.tenants import TenantTable, load_tenants_file
from scheduler_service.frontend.intake_limits import IntakeLimits
from scheduler_service.frontend.stream_backlog import (
    DEFAULT_MAX_BACKLOG_BYTES,
    DEFAULT_MAX_BACKLOG_TOKENS,
    BacklogLimits,
)
from scheduler_service.frontend.tracing import NO_TRACING, OtelTracing, Tracing
from scheduler_service.planner.discovery import (
    DEFAULT_RESOLVE_INTERVAL_S,
    DNS_PREFIX,
    split_target,
)
from scheduler_service.planner.engine_options import (
    DEFAULT_NO_EXECUTOR_TIMEOUT_S,
    DEFAULT_PREFILL_MIN_TOKENS,
    DEFAULT_REBALANCE_MIN_TOKENS_LEFT,
    EngineOptions,
)
from scheduler_service.planner.lane import (
    DEFAULT_STATE_CHECKPOINT_BLOCKS,
    DEFAULT_STEP_TIMEOUT_FACTOR,
    DEFAULT_STEP_TIMEOUT_FLOOR_S,
    LaneOptions,
)
from scheduler_service.process.all_in_one import run_all_in_one
from scheduler_service.process.event_loop import EVENT_LOOPS, event_loop_runner
from scheduler_service.process.frontend_server import FrontendOptions, serve_frontend
from scheduler_service.process.planner_server import PlannerOptions, serve_planner
from scheduler_service.process.role_flags import add_role_flags, role_options
from scheduler_service.process.server import (
    DEFAULT_DRAIN_TIMEOUT_S,
    ServerSettings,
    serve,
)
from scheduler_service.process.torch_free import forbid_torch
from scheduler_service.security_options import add_security_flags, security_options
from scheduler_service.text.generation_config import load_sampling_defaults
from scheduler_service.text.tokenizer import TextProcessor
from service_support.cli_help import DefaultsHelpFormatter
from service_support.default_ports import (
    DEFAULT_EXECUTOR_ADDRESS,
    DEFAULT_SCHEDULER_PORT,
)
from service_support.flag_types import (
    MAX_PORT,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from service_support.local_folder import FolderError
from service_support.log_format import add_log_format_flag, configure_logging
from service_support.parent_death import end_with_parent
from service_support.port_check import check_listen_ports

logger = logging.getLogger("scheduler_service")


def executor_target(text: str) -> str:
    """HOST:PORT, or dns:///NAME:PORT; anything else would only be dialled, in vain, forever."""
    if text.startswith(DNS_PREFIX):
        try:
            split_target(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (port 1..{MAX_PORT}) or dns:///NAME:PORT")
    return text


def parse_args(argv: list[str] | None, prog: str = "python -m scheduler_service") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve the splitserve Generation API.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--port", type=port_number, default=DEFAULT_SCHEDULER_PORT, help="gRPC port for clients; 0 picks a free one"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument(
        "--executor",
        type=executor_target,
        action="append",
        metavar="HOST:PORT",
        help="an executor to drive (repeat for several), or dns:///NAME:PORT for every address "
        "NAME resolves to, looked up again every --resolve-interval seconds (default: "
        f"{DEFAULT_EXECUTOR_ADDRESS}, an executor started here without --port)",
    )
    parser.add_argument(
        "--scheduler-id",
        help="identity presented to executors, which serve one scheduler at a time "
        "(default HOSTNAME:PORT; keep it stable so a restarted scheduler takes its executors back)",
    )
    parser.add_argument("--resolve-interval", type=positive_float, default=DEFAULT_RESOLVE_INTERVAL_S, help="seconds between DNS lookups of dns:/// executors")
    parser.add_argument(
        "--route-tokens-per-request",
        type=non_negative_int,
        default=DEFAULT_TOKENS_PER_REQUEST,
        help="routing: cached prompt tokens worth one more queued request on an executor "
        "(0: by prefix alone; large: by load alone)",
    )
    parser.add_argument(
        "--step-timeout-floor",
        type=positive_float,
        default=DEFAULT_STEP_TIMEOUT_FLOOR_S,
        help="seconds a step result may take before its executor counts as lost, at least "
        "(the deadline is this or --step-timeout-factor x the slowest recent step)",
    )
    parser.add_argument(
        "--step-timeout-factor",
        type=positive_float,
        default=DEFAULT_STEP_TIMEOUT_FACTOR,
        help="see --step-timeout-floor",
    )
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder; without it only token-id prompts are accepted")
    parser.add_argument(
        "--tokenizer-threads",
        type=positive_int,
        default=IntakeLimits().tokenizer_threads,
        help="prompts tokenized at once, smallest first; prompts over 16 Ki characters take at "
        "most all threads but one, so they never hold up small ones (default: one per core, at "
        "least 2)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|none|DIR",
        help="sampling defaults for fields a request leaves unset (temperature, top_k, top_p, "
        "min_p, repetition_penalty, max_tokens): auto reads generation_config.json in the "
        "--tokenizer folder, DIR the one in DIR; none (or vllm) keeps the built-in ones "
        "(temperature 1, top_p 1, top_k 0, min_p 0, repetition_penalty 1, max_tokens unset)",
    )
    parser.add_argument("--max-num-seqs", type=positive_int, default=256, help="most requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="most tokens computed per step")
    parser.add_argument(
        "--target-itl-ms",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="while requests decode, hold each step to about MS milliseconds (by the executor's "
        "step times so far): the decodes go first and prefill chunks get the tokens left, at least "
        "32, so a long prompt's prefill is spread over several steps rather than stalling every "
        "stream for one. Lowers the inter-token latency's tail at the cost of later first tokens "
        "for long prompts. Mixed --mode only. 0: off, prefill chunks fill --max-num-batched-tokens",
    )
    parser.add_argument(
        "--state-checkpoint-blocks",
        type=non_negative_int,
        default=DEFAULT_STATE_CHECKPOINT_BLOCKS,
        metavar="N",
        help="hybrid models (recurrent layers): keep a request's recurrent state every N full KV "
        "blocks, each in a state slot no running request holds (the executor's, state_slot_bytes "
        "each; running requests take them back first), so a prefix hit resumes from the last one "
        "it covers; 0 turns their prefix caching off, as does an executor without checkpoints",
    )
    parser.add_argument(
        "--speculative-method",
        choices=SPECULATIVE_METHODS,
        default="ngram",
        help="speculative decoding's proposer of draft tokens: ngram looks the request's last "
        "tokens up in its own tokens (prompt lookup); suffix also in the recent outputs of every "
        "request on this scheduler; draft asks the executor's draft model (its --draft-model)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="speculative decoding: at most K draft tokens per request and step, which the "
        "executor verifies in one forward (the outputs are those of decoding one token at a "
        "time); each request's K adapts to its acceptance. 0: off. Only for executors that "
        "verify drafts, and not for hybrid models",
    )
    parser.add_argument(
        "--speculative-max-batch",
        type=positive_int,
        default=DEFAULT_SPECULATIVE_MAX_BATCH,
        metavar="N",
        help="speculative decoding: no drafts in a step while N or more running requests are "
        "past their prompt (a batch that large keeps the executor busy without them)",
    )
    parser.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default="fcfs",
        help="queue order. fcfs: arrival; priority: lower request priority values first, "
        "earliest TTFT deadline among equals, and a waiting request preempts a running one of "
        "lower priority when the batch or the KV cache is full; fair: deficit round robin "
        "across tenants weighted by tokens served (--tenants-file weights), priority and "
        "deadline within a tenant",
    )
    parser.add_argument(
        "--tenants-file",
        type=Path,
        help="TOML file of tenants' weights and quotas (max_running, max_waiting, "
        "tokens_per_minute), [defaults] and [tenants.NAME]; Admin/ReloadTenants reads it again "
        "without a restart (README: Tenants, fairness and deadlines)",
    )
    parser.add_argument(
        "--mode",
        choices=[m.value for m in StepMode],
        default="mixed",
        help="mixed: decodes and prefill chunks share steps; prefill-first: a step with prefill "
        "work runs only that; decode-first: new requests start only when none is running",
    )
    parser.add_argument("--max-waiting", type=positive_int, default=10_000, help="queue length past which requests are refused")
    parser.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="tokens a stream gathers before sending them (its first token and its end go at "
        "once); above 1, fewer messages per token for less CPU at high concurrency, as vLLM's "
        "--stream-interval",
    )
    parser.add_argument(
        "--max-stream-backlog-tokens",
        type=positive_int,
        default=DEFAULT_MAX_BACKLOG_TOKENS,
        help="tokens a stream's client may fall behind (generated, not yet read) before its "
        "request is ended with RESOURCE_EXHAUSTED and its blocks freed; room for a reader that "
        "stalls a minute or two on a long generation (at least --stream-interval)",
    )
    parser.add_argument(
        "--max-stream-backlog-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BACKLOG_BYTES,
        help="the same in bytes of unread output (a few per token, ~300 with 20 logprobs): "
        "what one stream may hold for a slow or absent reader",
    )
    parser.add_argument(
        "--no-executor-timeout",
        type=non_negative_float,
        default=DEFAULT_NO_EXECUTOR_TIMEOUT_S,
        help="seconds a request waits while no executor can take it (all down, drained or "
        "refused) before it fails with UNAVAILABLE saying why",
    )
    parser.add_argument(
        "--prefill-min-tokens",
        type=non_negative_int,
        default=DEFAULT_PREFILL_MIN_TOKENS,
        help="with executors started --role prefill: prompts with at least this many uncached "
        "tokens are computed there and moved with their K/V to a decode executor after their "
        "first token; shorter ones are computed where they decode",
    )
    parser.add_argument(
        "--rebalance-min-tokens-left",
        type=non_negative_int,
        default=DEFAULT_REBALANCE_MIN_TOKENS_LEFT,
        help="an idle executor takes running requests (with their K/V) from a busier one when "
        "they have at least this many tokens left to generate; 0: only queued ones move",
    )
    parser.add_argument("--metrics-port", type=port_number, help="serve Prometheus metrics on this port")
    parser.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM: seconds the requests in flight get to finish (new ones are refused "
        "with UNAVAILABLE and health turns NOT_SERVING) before the rest are aborted",
    )
    add_log_format_flag(parser)
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the event loop every process of the scheduler runs on: uvloop (~17 %% less "
        "front-end CPU per token streamed), asyncio's own, or auto: uvloop when installed, as it "
        "is with the package",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        metavar="HOST:PORT",
        help="export OpenTelemetry spans of requests and steps over OTLP/gRPC to this collector "
        "(needs the tracing extra); callers' W3C traceparent is continued. Off when unset",
    )
    parser.add_argument(
        "--trace-dir",
        type=Path,
        help="record every step of every executor and every request's arrival and end into "
        "DIR (steps.jsonl, and trace.json for Perfetto), for `python -m scheduler_service.replay "
        "DIR`. Off when unset",
    )
    parser.add_argument(
        "--otlp-traces-insecure",
        action="store_true",
        help="send spans to the collector without TLS",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="on a start-up failure, log its traceback after the one-line reason",
    )
    add_security_flags(parser)
    add_role_flags(parser)
    _add_cap_flags(parser)
    args = parser.parse_args(argv)
    # Not the flag's default: argparse would append the executors given to it.
    args.executor = args.executor or [DEFAULT_EXECUTOR_ADDRESS]
    return args


def _add_cap_flags(parser: argparse.ArgumentParser) -> None:
    """Per-request caps (frontend/intake_limits.py); the receive limit follows from them."""
    caps = IntakeLimits()
    group = parser.add_argument_group("request caps (a request over one gets INVALID_ARGUMENT)")
    group.add_argument("--max-prompt-bytes", type=positive_int, default=caps.max_prompt_bytes, help="UTF-8 bytes of a text prompt or of a chat's contents together")
    group.add_argument("--max-prompt-tokens", type=positive_int, default=caps.max_prompt_tokens, help="token ids of a token-id prompt (the model's maximum length caps it too)")
    group.add_argument("--max-request-id-chars", type=positive_int, default=caps.max_request_id_chars, help="length of a request_id (printable ASCII without spaces)")
    group.add_argument("--max-cache-salt-bytes", type=positive_int, default=caps.max_cache_salt_bytes)
    group.add_argument("--max-stop-strings", type=positive_int, default=caps.max_stop_strings)
    group.add_argument("--max-stop-bytes", type=positive_int, default=caps.max_stop_bytes, help="UTF-8 bytes of one stop string")
    group.add_argument("--max-stop-token-ids", type=positive_int, default=caps.max_stop_token_ids)
    group.add_argument("--max-chat-messages", type=positive_int, default=caps.max_chat_messages)
    group.add_argument("--max-choices", type=positive_int, default=caps.max_choices, help="choices of one request (n, best_of)")
    group.add_argument(
        "--max-message-bytes",
        type=positive_int,
        default=caps.max_message_bytes,
        help="bytes of one message gRPC takes in at all (RESOURCE_EXHAUSTED beyond); a request "
        "over what the caps above allow but under this gets INVALID_ARGUMENT naming its field. "
        "gRPC buffers each message whole before it can be judged, so this bounds the memory a "
        "client's concurrent messages take (default: twice what the caps allow, 2.7 MiB at the "
        "default caps)",
    )
    group.add_argument(
        "--chat-roles",
        default=",".join(sorted(caps.chat_roles)),
        help="comma-separated roles a chat message may have",
    )


def tracing_of(args: argparse.Namespace) -> Tracing:
    if args.otlp_traces_endpoint is None:
        return NO_TRACING
    try:
        return OtelTracing.exporting_to(args.otlp_traces_endpoint, insecure=args.otlp_traces_insecure)
    except ImportError as missing:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry (pip install 'splitserve[tracing]'): {missing}"
        ) from None


def sampling_defaults(choice: str, tokenizer: Path | None) -> SamplingDefaults:
    if choice in ("none", "vllm"):
        return SamplingDefaults()
    if choice == "auto":
        return load_sampling_defaults(tokenizer) if tokenizer is not None else SamplingDefaults()
    folder = Path(choice)
    if not folder.is_dir():
        raise ValueError(f"--generation-config {choice!r} is not auto, none or a folder")
    return load_sampling_defaults(folder)


def intake_limits(args: argparse.Namespace) -> IntakeLimits:
    roles = frozenset(role.strip() for role in args.chat_roles.split(",") if role.strip())
    if not roles:
        raise ValueError("--chat-roles names no role")
    return IntakeLimits(
        max_prompt_bytes=args.max_prompt_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_request_id_chars=args.max_request_id_chars,
        max_cache_salt_bytes=args.max_cache_salt_bytes,
        max_stop_strings=args.max_stop_strings,
        max_stop_bytes=args.max_stop_bytes,
        max_stop_token_ids=args.max_stop_token_ids,
        max_chat_messages=args.max_chat_messages,
        max_choices=args.max_choices,
        max_message_bytes=args.max_message_bytes,
        chat_roles=roles,
        tokenizer_threads=args.tokenizer_threads,
    )


def text_processor(tokenizer: Path | None) -> TextProcessor | None:
    if tokenizer is None:
        return None
    try:
        return TextProcessor.from_pretrained(tokenizer)
    except FolderError as error:
        raise FolderError(f"--tokenizer {error}") from error


def main(argv: list[str] | None = None, prog: str = "python -m scheduler_service") -> int:
    args = parse_args(argv, prog)
    configure_logging(args.log_format)
    end_with_parent()
    try:
        security = security_options(args)
        roles = role_options(args)
        limits = intake_limits(args)
        # Before the tokenizer loads (seconds), not once serve() fails to bind. A front-end
        # serves no metrics (the planner holds them all); one sharing its port leaves that and
        # the health port to their owner.
        ports = {"--port": args.port, "--health-port": args.health_port, "--metrics-port": args.metrics_port}
        if roles.role == "frontend":
            ports = {} if roles.reuse_port else {"--port": args.port, "--health-port": args.health_port}
            if args.metrics_port is not None and not roles.reuse_port:
                logger.warning("event=metrics_port_ignored advice='a front-end has no metrics: scrape its planner'")
        check_listen_ports(args.host, ports)
        if roles.role == "frontend":
            forbid_torch()
        defaults = sampling_defaults(args.generation_config, args.tokenizer)
        tenants = load_tenants_file(args.tenants_file) if args.tenants_file else TenantTable()
        text = text_processor(args.tokenizer)
        tracing = tracing_of(args)
        run = event_loop_runner(args.event_loop)
    except ValueError as error:
        logger.error("event=scheduler_refused reason=%r", str(error), exc_info=args.verbose)
        return 2
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        executors=tuple(args.executor),
        text=text,
        metrics_port=args.metrics_port,
        scheduler_id=args.scheduler_id,
        resolve_interval_s=args.resolve_interval,
        limits=limits,
        sampling_defaults=defaults,
        tracing=tracing,
        trace_dir=args.trace_dir,
        tls=security.tls,
        api_keys=security.api_keys,
        admin_keys=security.admin_keys,
        executor_tls=security.executor_tls,
        executor_token=security.executor_token,
        health_port=args.health_port,
        drain_timeout_s=args.drain_timeout,
        tenants=tenants,
        options=EngineOptions(
            lane=LaneOptions(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                policy=Policy(args.policy),
                mode=StepMode(args.mode),
                step_timeout_floor_s=args.step_timeout_floor,
                step_timeout_factor=args.step_timeout_factor,
                state_checkpoint_blocks=args.state_checkpoint_blocks,
                speculative_method=args.speculative_method,
                num_speculative_tokens=args.num_speculative_tokens,
                speculative_max_batch=args.speculative_max_batch,
                target_itl_s=args.target_itl_ms / 1000,
            ),
            max_waiting=args.max_waiting,
            route_tokens_per_request=args.route_tokens_per_request,
            stream_interval=args.stream_interval,
            stream_backlog=BacklogLimits(args.max_stream_backlog_tokens, args.max_stream_backlog_bytes),
            no_executor_timeout_s=args.no_executor_timeout,
            prefill_min_tokens=args.prefill_min_tokens,
            rebalance_min_tokens_left=args.rebalance_min_tokens_left,
        ),
    )
    logger.info(
        "event=scheduler_starting role=%s port=%d executors=%s tokenizer=%s sampling_defaults=%r",
        roles.role, args.port, ",".join(args.executor), args.tokenizer, defaults,
    )
    if roles.role == "frontend":
        return run(
            serve_frontend(settings, FrontendOptions(roles.planners, roles.planner_token, roles.reuse_port, roles.planner_tls))
        )
    if roles.role == "planner":
        return run(serve_planner(settings, PlannerOptions(roles.planner_token, roles.insecure_planner, tls=security.tls)))
    if roles.frontends > 1:
        return run_all_in_one(settings, roles.frontends, sys.argv[1:] if argv is None else argv, run)
    return run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
