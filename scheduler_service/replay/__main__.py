"""python -m scheduler_service.replay DIR [--policy fcfs,priority] [--mode ...]
[--max-num-batched-tokens N,...] [--max-num-seqs N,...] [--executors N] [--json OUT] [--png OUT.png]
python -m scheduler_service.replay --scenario prefill-first|preemption|decode-first --png OUT.png

Replays a step trace (recorded with --trace-dir DIR) through the real scheduler core against the
simulated executor, whose step time is fitted to the trace, once per combination of the values
given (unset: as recorded), and prints per configuration TTFT and end-to-end p50/p99,
throughput, preemptions and KV use; --json writes the same. --png draws the replay of the
first configuration (or a built-in scenario of the seed document).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from pathlib import Path

from scheduler_service.core.config import SchedulingKnobs
from scheduler_service.core.policy import Policy, StepMode
from scheduler_service.replay.fleet import replay_fleet
from scheduler_service.replay.scenarios import SCENARIOS, run_scenario
from scheduler_service.replay.simulate import Replayed, config_of, replay_timeline
from scheduler_service.replay.step_cost import StepCost, fit_step_cost
from scheduler_service.replay.summary import Summary, summarize
from scheduler_service.replay.trace_reader import Timeline, read_trace
from service_support.cli_help import DefaultsHelpFormatter

logger = logging.getLogger("scheduler_service.replay")


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("trace_dir", nargs="?", type=Path, help="folder a scheduler wrote with --trace-dir")
    parser.add_argument("--policy", help="comma-separated: fcfs, priority")
    parser.add_argument("--mode", help="comma-separated: mixed, prefill-first, decode-first")
    parser.add_argument("--max-num-batched-tokens", help="comma-separated token budgets")
    parser.add_argument("--max-num-seqs", help="comma-separated limits on running requests")
    parser.add_argument(
        "--executors", type=int, help="replay over this many simulated executors, each request routed by the scheduler's router (default: each recorded executor on its own)"
    )
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help="a built-in scenario of the seed document instead of a trace")
    parser.add_argument("--json", type=Path, help="write the summaries (and the step-cost fit) here")
    parser.add_argument("--png", type=Path, help="draw queues, batches, KV use and preemptions here")
    args = parser.parse_args(argv)
    if (args.trace_dir is None) == (args.scenario is None):
        parser.error("give a trace folder or --scenario, not both")
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


def replay_trace(
    timelines: list[Timeline], grid: list[SchedulingKnobs | None], cost: StepCost, executors: int | None = None
) -> list[tuple[Summary, list[Replayed]]]:
    runs = []
    for knobs in grid:
        label = label_of(knobs)
        if executors is None:
            replays = [replay_timeline(timeline, knobs, cost) for timeline in timelines]
        else:
            config = config_of(timelines[0])
            config = knobs.applied_to(config) if knobs is not None else config
            depth = int(timelines[0].config.get("pipeline_depth", 2))
            replays = replay_fleet(timelines, config, cost, executors, depth)
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
    header = f"{'configuration':<44} {'reqs':>5} {'TTFT p50':>9} {'p99':>8} {'e2e p50':>8} {'p99':>8} {'out tok/s':>10} {'preempt':>8} {'KV mean':>8} {'KV max':>7} {'steps':>6} {'as recorded':>12}"
    print(header)
    for s in summaries:
        print(
            f"{s.label:<44} {s.requests:>5} {s.ttft_p50_s:>9.3f} {s.ttft_p99_s:>8.3f} {s.e2e_p50_s:>8.3f} {s.e2e_p99_s:>8.3f} "
            f"{s.output_tokens_per_s:>10.1f} {s.preemptions:>8} {s.kv_usage_mean:>8.1%} {s.kv_usage_max:>7.1%} {s.steps:>6} "
            f"{s.matched_steps:>5}/{s.recorded_steps:<6}"
        )


def main(argv: list[str] | None = None, prog: str = "python -m scheduler_service.replay") -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
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
        except ValueError as bad:
            logger.error("event=replay_refused reason=%r", str(bad))
            return 2
        if args.executors is not None and args.executors < 1:
            logger.error("event=replay_refused reason=%r", "--executors must be at least 1")
            return 2
        runs = replay_trace(timelines, grid, cost, args.executors)
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
