"""Where an executor step's time goes: the throughput benchmark's workload (random Llama, 32
requests, prompts 32-512, 128 new tokens) planned by the real scheduler core and run by the real
ModelRunner in this process (no gRPC), with each phase of every step timed.

    python -m bench.step_profile [--threads 2] [--hidden 512] [--layers 8] [--ops 12]
        [--model DIR] [--attention-backend auto|sdpa|cpu_paged] [--no-packed-linear]
        [--no-decode-program]

--model profiles a real model folder (e.g. the prepared SmolLM2) instead of the random Llama.
A fused Llama's pure decode steps run their layers as one C call
(executor_service/cpu_forward/decode_program.py), inside which attention is not timed apart: its
share lands in "forward rest". --no-decode-program runs them through the Python layer loop,
where it is.

Steps are split into those with prefill work and pure decodes. For each kind: steps, mean ms,
and the share of the step spent building inputs, in attention (our paged attention function,
K/V writes included), in the rest of the forward (linear layers, norms, activations, the lm_head
over sampled rows), in sampling, and elsewhere (validation, result records). Then the torch
profiler's top operators by self CPU time over a window of decode steps and of prefill steps.
Shares are what to read; absolute times vary with the machine's load.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface, AutoConfig

from bench.throughput import build_bench_model
from bench.throughput_workload import BenchConfig, make_prompts
from executor_service.attention.paged_attention import (
    ATTENTION_NAME,
    paged_attention_forward,
)
from executor_service.runner import model_runner
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.startup import build_executor
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_plan import StepPlan
from scheduler_service.planner.plan_codec import output_from_proto, plan_to_proto

PHASES = ("inputs", "attention", "forward_rest", "sampling", "other")


@dataclass(slots=True)
class Breakdown:
    steps: int = 0
    total_s: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def row(self, kind: str) -> str:
        shares = " | ".join(f"{self.phases[p] / self.total_s:.0%}" for p in PHASES)
        return f"| {kind} | {self.steps} | {1000 * self.total_s / max(1, self.steps):.1f} | {shares} |"


class PhaseClock:
    """Seconds per phase of the step being run, from wrappers around the runner's parts."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - started

        return timed


@contextmanager
def timed_runner(clock: PhaseClock) -> Iterator[None]:
    """The runner's input building, forward and sampling, and our attention function, timed."""
    originals = {name: getattr(model_runner, name) for name in ("build_step_inputs", "compute_logits", "sample_batch")}
    setattr(model_runner, "build_step_inputs", clock.wrap("inputs", originals["build_step_inputs"]))
    setattr(model_runner, "compute_logits", clock.wrap("forward", originals["compute_logits"]))
    setattr(model_runner, "sample_batch", clock.wrap("sampling", originals["sample_batch"]))
    AttentionInterface.register(ATTENTION_NAME, clock.wrap("attention", paged_attention_forward))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(model_runner, name, original)
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def workload(
    config: BenchConfig,
    directory: Path,
    model_dir: Path | None = None,
    attention_backend: str = "auto",
    packed_linear: bool = True,
    decode_program: bool = True,
) -> tuple[model_runner.ModelRunner, Scheduler]:
    """A runner for the model (the random Llama, built under directory, unless model_dir) and a
    scheduler holding the workload's requests; decode_program False keeps pure decode steps on
    the Python layer loop."""
    torch.set_num_threads(config.threads)
    if model_dir is None:
        model_dir = build_bench_model(config, directory / "llama")
    settings = ExecutorSettings(
        model_dir=model_dir,
        device="cpu",
        num_kv_blocks=config.num_kv_blocks,
        block_size=config.block_size,
        attention_backend=attention_backend,
        packed_linear=packed_linear,
    )
    runner = build_executor(settings).runner
    if not decode_program and runner.loaded.lean is not None:
        runner.loaded.lean.program = None
    scheduler = Scheduler(
        SchedulerConfig(
            num_kv_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            max_num_seqs=config.requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
    )
    sampling = SamplingParams(max_tokens=config.new_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(make_prompts(config)):
        scheduler.add_request(Request(f"r{index}", prompt, sampling))
    return runner, scheduler


def step_kind(plan: StepPlan) -> str:
    """"prefill" for a step with prompt tokens in it, else "decode"."""
    prefill = plan.new_requests or any(c.num_scheduled_tokens > 1 for c in plan.continuing_requests)
    return "prefill" if prefill else "decode"


def run(
    config: BenchConfig,
    directory: Path,
    top_ops: int,
    model_dir: Path | None = None,
    attention_backend: str = "auto",
    packed_linear: bool = True,
    decode_program: bool = True,
) -> str:
    runner, scheduler = workload(config, directory, model_dir, attention_backend, packed_linear, decode_program)
    kinds = {"prefill": Breakdown(), "decode": Breakdown()}
    profiles: dict[str, profile] = {}
    clock = PhaseClock()
    with timed_runner(clock):
        while scheduler.has_unfinished():
            plan = scheduler.schedule()
            kind = step_kind(plan)
            message = plan_to_proto(plan)
            clock.current.clear()
            profiler = _profiler_for(kind, kinds[kind].steps, profiles)
            started = time.perf_counter()
            if profiler is not None:
                with profiler:
                    result = runner.execute(message)
            else:
                result = runner.execute(message)
            elapsed = time.perf_counter() - started
            scheduler.update(output_from_proto(result))
            record = kinds[kind]
            record.steps += 1
            record.total_s += elapsed
            phases = clock.current
            record.phases["inputs"] += phases["inputs"]
            record.phases["attention"] += phases["attention"]
            record.phases["forward_rest"] += phases["forward"] - phases["attention"]
            record.phases["sampling"] += phases["sampling"]
            record.phases["other"] += elapsed - phases["inputs"] - phases["forward"] - phases["sampling"]
    lines = [
        f"{(model_dir or Path('random-llama')).name}: {runner.loaded.num_layers} layers, {config.requests} requests, "
        f"{config.threads} threads, fp32, attention {runner.backend}",
        "| steps | count | mean ms | inputs | attention | forward rest | sampling | other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        kinds["prefill"].row("with prefill"),
        kinds["decode"].row("decode only"),
    ]
    for kind, recorded in profiles.items():
        lines.append(f"\ntop operators, one {kind} step (self CPU time):")
        lines.append(recorded.key_averages().table(sort_by="self_cpu_time_total", row_limit=top_ops))
    return "\n".join(lines)


def _profiler_for(kind: str, seen: int, profiles: dict[str, profile]) -> profile | None:
    """Profiles the second step of each kind (the first warms caches up)."""
    if seen != 1 or kind in profiles:
        return None
    profiles[kind] = profile(activities=[ProfilerActivity.CPU])
    return profiles[kind]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ops", type=int, default=12, help="operators listed per profiled step")
    parser.add_argument("--model", type=Path, default=None, help="a model folder instead of the random Llama")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-packed-linear", dest="packed_linear", action="store_false")
    parser.add_argument("--no-decode-program", dest="decode_program", action="store_false")
    args = parser.parse_args()
    vocab = BenchConfig().vocab
    if args.model is not None:
        vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    config = BenchConfig(
        requests=args.requests,
        new_tokens=args.new_tokens,
        hidden=args.hidden,
        layers=args.layers,
        threads=args.threads,
        vocab=vocab,
    )
    with tempfile.TemporaryDirectory(prefix="bench-step-profile-") as tmp:
        report = run(
            config, Path(tmp), args.ops, args.model, args.attention_backend, args.packed_linear, args.decode_program
        )
        print(report)


if __name__ == "__main__":
    main()
