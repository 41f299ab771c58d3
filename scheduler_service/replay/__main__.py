"""python -m scheduler_service.replay DIR [--policy fcfs,priority,fair] [--mode ...]
[--max-num-batched-tokens N,...] [--max-num-seqs N,...] [--target-itl-ms MS,...] [--executors N]
[--json OUT] [--png OUT.png]
python -m scheduler_service.replay --scenario prefill-first|preemption|decode-first --png OUT.png
python -m scheduler_service.replay --synthesize [TENANTS] [--duration-s S] [--seed N]
[--policy fcfs,priority,fair] [--executors N] [--prompt-tokens N] [--output-tokens N]
[--max-prompt-tokens N] [--max-output-tokens N] [--length-sigma X] [--step-cost MS,MS,MS]
[--num-kv-blocks N] [--json OUT] [--png OUT.png]

Replays a step trace (recorded with --trace-dir DIR) through the real scheduler core against the
simulated executor, whose step time is fitted to the trace, once per combination of the values
given (unset: as recorded), and prints per configuration TTFT, inter-token latency and
end-to-end p50/p99, throughput, preemptions and KV use; --json writes the same. --png draws the
replay of the first configuration (or a built-in scenario of the seed document).

--synthesize replays a synthesised multi-tenant trace instead (replay/tenant_traces.py):
TENANTS is NAME:key=value[:key=value...] separated by commas, keys rate (requests/s, Poisson),
weight, priority, ttft_ms, tpot_ms, prompt and output (median tokens), e.g.
`a:rate=40:ttft_ms=2000,b:rate=4:weight=2`; lengths are lognormal about their medians, capped,
and drawn from --seed. Each policy (default all three) runs over --executors simulated executors
as the planner drives them: one fair-share ledger over every executor, the router's placement,
deadline admission refusing at arrival a request forecast to miss its targets. It prints a
markdown table per policy and tenant: requests, rejected at arrival, TTFT and TPOT p50/p99,
share of admitted requests meeting their TTFT deadline and per-token target, output tokens/s,
and Jain's fairness index of the tenants' token throughput per weight, measured over the window
in which every tenant had requests waiting (fair queuing can equalise only tenants that ask for
more than they get; replay/tenant_report.py). The default trace is two tenants at 10:1 request
rates, both asking for more than half the executor.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from scheduler_service.core.config import SchedulerConfig, SchedulingKnobs
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.replay.fleet import replay_fleet, replay_requests
from scheduler_service.replay.scenarios import SCENARIOS, run_scenario
from scheduler_service.replay.simulate import (
    Replayed,
    config_of,
    recorded_target_itl_s,
    replay_timeline,
)
from scheduler_service.replay.step_cost import StepCost, fit_step_cost
from scheduler_service.replay.summary import Summary, summarize
from scheduler_service.replay.tenant_report import markdown_table, tenant_report
from scheduler_service.replay.tenant_traces import (
    DEFAULT_STEP_COST_MS,
    DEFAULT_TENANTS,
    SYNTHETIC_BLOCK_SIZE,
    SYNTHETIC_KNOBS,
    Lengths,
    parse_tenants,
    synthesize,
)
from scheduler_service.replay.trace_reader import Timeline, read_trace
from service_support.cli_help import DefaultsHelpFormatter

logger = logging.getLogger("scheduler_service.replay")


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("trace_dir", nargs="?", type=Path, help="folder a scheduler wrote with --trace-dir")
    parser.add_argument("--policy", help="comma-separated: fcfs, priority, fair (with --synthesize, default all three)")
    parser.add_argument("--mode", help="comma-separated: mixed, prefill-first, decode-first")
    parser.add_argument("--max-num-batched-tokens", help="comma-separated token budgets")
    parser.add_argument("--max-num-seqs", help="comma-separated limits on running requests")
    parser.add_argument(
        "--target-itl-ms",
        help="comma-separated values of the scheduler's --target-itl-ms (0: none); unset: as recorded",
    )
    parser.add_argument(
        "--executors", type=int, help="replay over this many simulated executors, each request routed by the scheduler's router (default: each recorded executor on its own; with --synthesize, 1)"
    )
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help="a built-in scenario of the seed document instead of a trace")
    parser.add_argument(
        "--synthesize", nargs="?", const=DEFAULT_TENANTS, metavar="TENANTS",
        help=f"replay a synthesised multi-tenant trace instead of a recorded one (alone: {DEFAULT_TENANTS})",
    )
    synthetic = Lengths()
    parser.add_argument("--duration-s", type=float, default=20.0, help="--synthesize: seconds in which requests arrive")
    parser.add_argument("--seed", type=int, default=0, help="--synthesize: seed of arrivals and lengths")
    parser.add_argument("--prompt-tokens", type=int, default=synthetic.prompt_median, help="--synthesize: median prompt length")
    parser.add_argument("--output-tokens", type=int, default=synthetic.output_median, help="--synthesize: median output length")
    parser.add_argument("--max-prompt-tokens", type=int, default=synthetic.max_prompt, help="--synthesize: longest prompt")
    parser.add_argument("--max-output-tokens", type=int, default=synthetic.max_output, help="--synthesize: longest output (every request's max_tokens)")
    parser.add_argument("--length-sigma", type=float, default=synthetic.sigma, help="--synthesize: sigma of the lognormal lengths (larger: heavier tail)")
    parser.add_argument(
        "--step-cost", default=",".join(f"{v:g}" for v in DEFAULT_STEP_COST_MS),
        help="--synthesize: a step's milliseconds: overhead,per prefill token,per decode token",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=8192, help=f"--synthesize: KV blocks of {SYNTHETIC_BLOCK_SIZE} tokens per executor")
    parser.add_argument("--json", type=Path, help="write the summaries (and the step-cost fit) here")
    parser.add_argument("--png", type=Path, help="draw queues, batches, KV use and preemptions here")
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.trace_dir, args.scenario, args.synthesize)) != 1:
        parser.error("give one of a trace folder, --scenario and --synthesize")
    return args


def knob_grid(args: argparse.Namespace, recorded: SchedulingKnobs) -> list[SchedulingKnobs | None]:
    """One SchedulingKnobs per combination; [None] (as recorded) when no knob is given."""
    if not any((args.policy, args.mode, args.max_num_batched_tokens, args.max_num_seqs)):
        return [None]
    policies = [Policy(v) for v in _values(args.policy)] or [recorded.policy]
    modes = [StepMode(v) for v in _values(args.mode)] or [recorded.mode]
    budgets = [int(v) for v in _values(args.max_num_batched_tokens)] or [recorded.max_num_batched_tokens]
    seats = [int(v) for v in _values(args.max_num_seqs)] or [recorded.max_num_seqs]
    return [SchedulingKnobs(*combination) for combination in itertools.product(policies, modes, budgets, seats)]


def _values(text: str | None) -> list[str]:
    return [value.strip() for value in text.split(",") if value.strip()] if text else []


def label_of(knobs: SchedulingKnobs | None) -> str:
    if knobs is None:
        return "as recorded"
    return f"{knobs.policy.value}/{knobs.mode.value}/tokens={knobs.max_num_batched_tokens}/seqs={knobs.max_num_seqs}"


def target_grid(text: str | None) -> list[float | None]:
    """--target-itl-ms's values in seconds; [None] (as recorded) when none is given."""
    values = [float(value) for value in _values(text)]
    if any(not value >= 0 for value in values):
        raise ValueError(f"--target-itl-ms values must be 0 or more, got {text!r}")
    return [value / 1000 for value in values] or [None]


def replay_trace(
    timelines: list[Timeline], grid: list[SchedulingKnobs | None], cost: StepCost, executors: int | None = None,
    targets: Sequence[float | None] = (None,),
) -> list[tuple[Summary, list[Replayed]]]:
    """targets: the --target-itl-ms values to replay each configuration under, in seconds (None:
    as recorded)."""
    runs = []
    for knobs, target in itertools.product(grid, targets):
        label = label_of(knobs) + ("" if target is None else f" itl={target * 1000:g}ms")
        if executors is None:
            replays = [replay_timeline(timeline, knobs, cost, target) for timeline in timelines]
        else:
            config = config_of(timelines[0])
            config = knobs.applied_to(config) if knobs is not None else config
            depth = int(timelines[0].config.get("pipeline_depth", 2))
            fleet_target = recorded_target_itl_s(timelines[0]) if target is None else target
            replays = replay_fleet(timelines, config, cost, executors, depth, target_itl_s=fleet_target)
            label = f"{label} x{executors} executors"
        runs.append((summarize(label, replays), replays))
    return runs


def print_table(summaries: list[Summary], cost: StepCost | None) -> None:
    if cost is not None:
        print(
            f"step cost fitted to {cost.num_steps} recorded steps: {cost.overhead_s * 1e3:.2f} ms + "
            f"{cost.per_prefill_token_s * 1e6:.1f} us/prefill token + {cost.per_decode_token_s * 1e6:.1f} us/decode token "
            f"(mean abs error {cost.mean_abs_error_pct:.1f} %, R^2 {cost.r_squared:.3f})"
        )
    header = f"{'configuration':<44} {'reqs':>5} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'e2e p50':>8} {'p99':>8} {'out tok/s':>10} {'preempt':>8} {'KV mean':>8} {'KV max':>7} {'steps':>6} {'as recorded':>12}"
    print(header)
    for s in summaries:
        print(
            f"{s.label:<44} {s.requests:>5} {s.ttft_p50_s:>9.3f} {s.ttft_p99_s:>8.3f} {s.itl_p50_s:>8.3f} {s.itl_p99_s:>8.3f} "
            f"{s.e2e_p50_s:>8.3f} {s.e2e_p99_s:>8.3f} "
            f"{s.output_tokens_per_s:>10.1f} {s.preemptions:>8} {s.kv_usage_mean:>8.1%} {s.kv_usage_max:>7.1%} {s.steps:>6} "
            f"{s.matched_steps:>5}/{s.recorded_steps:<6}"
        )


def replay_synthesized(args: argparse.Namespace) -> int:
    try:
        tenants = parse_tenants(args.synthesize)
        lengths = Lengths(args.prompt_tokens, args.output_tokens, args.max_prompt_tokens, args.max_output_tokens, args.length_sigma)
        overhead_ms, prefill_ms, decode_ms = (float(v) for v in args.step_cost.split(","))
        if min(lengths.prompt_median, lengths.output_median, lengths.max_prompt, lengths.max_output) < 1 or lengths.sigma < 0:
            raise ValueError("token lengths must be at least 1 and --length-sigma not negative")
        if min(overhead_ms, prefill_ms, decode_ms) < 0 or args.duration_s <= 0 or (args.executors or 1) < 1:
            raise ValueError("--step-cost must not be negative, --duration-s must be positive, --executors at least 1")
        config = SchedulerConfig(
            num_kv_blocks=args.num_kv_blocks, block_size=SYNTHETIC_BLOCK_SIZE,
            max_model_len=lengths.max_prompt + lengths.max_output,
        )
        if config.max_seq_len < config.max_model_len:
            raise ValueError(f"--num-kv-blocks {args.num_kv_blocks} cannot hold the longest prompt and output ({config.max_model_len} tokens)")
        if args.policy is None:
            args.policy = ",".join(policy.value for policy in Policy)
        grid = knob_grid(args, SYNTHETIC_KNOBS)
    except ValueError as bad:
        logger.error("event=replay_refused reason=%r", str(bad))
        return 2
    cost = StepCost(overhead_ms / 1e3, prefill_ms / 1e3, decode_ms / 1e3, 0.0, 1.0, 0)
    traced = synthesize(tenants, args.duration_s, lengths, args.seed)
    weights = {t.name: t.weight for t in tenants}
    executors = args.executors or 1
    print(
        f"synthesised trace: {len(traced)} requests of {len(tenants)} tenants over {args.duration_s:g} s (seed {args.seed}); "
        f"step {overhead_ms:g} ms + {prefill_ms:g} ms/prefill token + {decode_ms:g} ms/decode token; "
        "Jain's index over the seconds in which every tenant had requests waiting\n"
    )
    reports, first = [], None
    for knobs in grid:
        assert knobs is not None
        run = replay_requests(traced, knobs.applied_to(config), cost, executors, weight_of=weights.__getitem__)
        label = f"{label_of(knobs)} x{executors}"
        reports.append(tenant_report(label, run, weights.__getitem__, [t.name for t in tenants]))
        first = first or (label, run.replays)
    print(markdown_table(reports))
    if args.json is not None:
        document = {
            "trace": {
                "tenants": [asdict(t) for t in tenants], "duration_s": args.duration_s, "seed": args.seed,
                "lengths": asdict(lengths), "requests": len(traced),
                "step_cost_ms": {"overhead": overhead_ms, "per_prefill_token": prefill_ms, "per_decode_token": decode_ms},
            },
            "configurations": [report.as_dict() for report in reports],
        }
        args.json.write_text(json.dumps(document, indent=2))
    if args.png is not None and first is not None:
        from scheduler_service.replay.pictures import draw

        draw(first[1], args.png, f"splitserve schedule: {first[0]}")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m scheduler_service.replay") -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    if args.synthesize is not None:
        return replay_synthesized(args)
    if args.scenario is not None:
        replayed = run_scenario(SCENARIOS[args.scenario])
        summary = summarize(args.scenario, [replayed])
        print_table([summary], None)
        runs, cost = [(summary, [replayed])], None
    else:
        try:
            timelines = read_trace(args.trace_dir)
        except FileNotFoundError as missing:
            logger.error("event=replay_refused reason=%r", str(missing))
            return 2
        if not timelines:
            logger.error("event=replay_refused reason=%r", "the trace holds no executor")
            return 2
        cost = fit_step_cost([plan for timeline in timelines for plan in timeline.plans])
        recorded = SchedulingKnobs.of(config_of(timelines[0]))
        try:
            grid = knob_grid(args, recorded)
            targets = target_grid(args.target_itl_ms)
        except ValueError as bad:
            logger.error("event=replay_refused reason=%r", str(bad))
            return 2
        if args.executors is not None and args.executors < 1:
            logger.error("event=replay_refused reason=%r", "--executors must be at least 1")
            return 2
        runs = replay_trace(timelines, grid, cost, args.executors, targets)
        print_table([summary for summary, _ in runs], cost)
    if args.json is not None:
        document = {"configurations": [summary.as_dict() for summary, _ in runs]}
        if cost is not None:
            document["step_cost"] = {
                "overhead_s": cost.overhead_s, "per_prefill_token_s": cost.per_prefill_token_s,
                "per_decode_token_s": cost.per_decode_token_s, "mean_abs_error_pct": cost.mean_abs_error_pct,
                "r_squared": cost.r_squared, "num_steps": cost.num_steps,
            }
        args.json.write_text(json.dumps(document, indent=2))
    if args.png is not None:
        from scheduler_service.replay.pictures import draw

        summary, replays = runs[0]
        draw(replays, args.png, f"splitserve schedule: {summary.label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
