"""Speculative decoding in process, time split by step kind: the quote workload of bench.speculation
planned by the real Scheduler core and run by the real ModelRunner (no gRPC, no pipelining, one
plan at a time), with and without ngram drafts. Steps with prefill work and decode-only steps are
timed apart, so the table says how much drafts shorten the decode steps and what that leaves of
the whole run, where prefill, which drafts do not shorten, keeps its share.

    python -m bench.speculation_split [--model smollm2|DIR] [--requests 16] [--concurrency 4]
        [--max-tokens 160] [--k 4] [--threads 1] [--json OUT]

--concurrency is the scheduler's max_num_seqs (bench.speculation's clients send that many at a
time). The model folder must hold a tokenizer with a chat template.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.disaggregation import SMOLLM2, resolve_model
from bench.speculation_workloads import add_workload_arguments, quote_requests
from executor_service.runner.model_runner import ModelRunner
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_plan import StepPlan
from scheduler_service.planner.plan_codec import output_from_proto, plan_to_proto
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger("bench.speculation_split")
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 1024


@dataclass(slots=True, frozen=True)
class Split:
    k: int
    output_tokens: int
    seconds: float
    prefill_s: float
    decode_s: float
    steps: int
    drafted: int
    accepted: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _has_prefill(plan: StepPlan) -> bool:
    """Whether a step computes prompt (or recomputed) tokens beyond each request's last token and
    its drafts."""
    return bool(plan.new_requests) or any(
        entry.num_scheduled_tokens > 1 + len(entry.draft_token_ids) for entry in plan.continuing_requests
    )


def run(runner: ModelRunner, eos: list[int], prompts: list[list[int]], k: int, concurrency: int, max_tokens: int) -> tuple[Split, dict[str, list[int]]]:
    runner.drop_all_requests(wipe_kv=True)
    config = SchedulerConfig(
        num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE, max_model_len=runner.limits.max_model_len,
        max_num_seqs=concurrency, num_speculative_tokens=k,
    )
    scheduler = Scheduler(config, eos_token_ids=eos)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.0)
    for index, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{index}", prompt, sampling))
    outputs: dict[str, list[int]] = {}
    prefill_s = decode_s = 0.0
    steps = 0
    started = time.perf_counter()
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        if not plan.has_work:
            continue
        step_started = time.perf_counter()
        result = runner.execute(plan_to_proto(plan, eos))
        spent = time.perf_counter() - step_started
        if _has_prefill(plan):
            prefill_s += spent
        else:
            decode_s += spent
        steps += 1
        for update in scheduler.update(output_from_proto(result)):
            if update.error is not None:
                raise RuntimeError(f"request {update.request_id}: {update.error.message}")
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    seconds = time.perf_counter() - started
    speculation = scheduler.speculation
    split = Split(
        k, sum(map(len, outputs.values())), seconds, prefill_s, decode_s, steps,
        speculation.num_draft_tokens, speculation.num_accepted_tokens,
    )
    logger.info("event=split_done %s", " ".join(f"{key}={value}" for key, value in asdict(split).items()))
    return split, outputs


def format_table(off: Split, on: Split) -> str:
    lines = [
        "| drafts | output tok/s | whole run x off | prefill steps s | decode steps s | decode x off | steps | acceptance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for split in (off, on):
        acceptance = f"{split.accepted / split.drafted:.2f}" if split.drafted else ""
        lines.append(
            f"| {'off' if not split.k else f'ngram K={split.k}'} | {split.tokens_per_s:.1f} | "
            f"{split.tokens_per_s / off.tokens_per_s:.2f} | {split.prefill_s:.2f} | {split.decode_s:.2f} | "
            f"{off.decode_s / split.decode_s:.2f} | {split.steps} | {acceptance} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, SMOLLM2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        model = resolve_model(args.model, Path(directory))
        text = TextProcessor.from_pretrained(model.path)
        prompts = [text.encode_chat(messages, add_generation_prompt=True) for messages in quote_requests(args.requests)]
        ready = build_executor(
            ExecutorSettings(model_dir=model.path, device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE)
        )
        eos = list(ready.info.eos_token_ids)
        off, plain = run(ready.runner, eos, prompts, 0, args.concurrency, args.max_tokens)
        on, drafted = run(ready.runner, eos, prompts, args.k, args.concurrency, args.max_tokens)
    identical = plain == drafted
    print(f"model: {args.model} ({model.description}); in process, one plan at a time, {args.threads} thread(s)")
    print(f"quote: {args.requests} greedy chats, {args.concurrency} at a time, up to {args.max_tokens} new tokens; outputs identical: {identical}")
    print(format_table(off, on))
    if args.json is not None:
        args.json.write_text(json.dumps({"identical": identical, "off": asdict(off), "ngram": asdict(on)}, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
