"""What recording the step trace (--trace-dir) costs: the fixed workload of bench.throughput
through the real services, with and without the trace, alternated so drift in the machine's
speed hits both alike; prints output tok/s of each run and the ratio of the medians.

    python -m bench.trace_overhead [--rounds 3] [bench.throughput's workload flags]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from bench.throughput import build_bench_model
from bench.throughput_splitserve import run_splitserve
from bench.throughput_workload import BenchConfig, make_prompts

logger = logging.getLogger("bench.trace_overhead")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    for f in fields(BenchConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = BenchConfig(**{f.name: getattr(args, f.name) for f in fields(BenchConfig)})
    prompts = make_prompts(config)
    plain: list[float] = []
    traced: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as tmp:
        model_dir = build_bench_model(config, Path(tmp) / "llama")
        for round_index in range(args.rounds):
            plain.append(run_splitserve(model_dir, prompts, config).tokens_per_s)
            trace_dir = Path(tmp) / f"trace-{round_index}"
            traced.append(run_splitserve(model_dir, prompts, config, {"trace_dir": trace_dir}).tokens_per_s)
            print(f"round {round_index + 1}: without trace {plain[-1]:.1f} tok/s, with trace {traced[-1]:.1f} tok/s", flush=True)
    ratio = statistics.median(traced) / statistics.median(plain)
    print(f"median output tok/s: without {statistics.median(plain):.1f}, with trace {statistics.median(traced):.1f}; ratio {ratio:.3f} (cost {100 * (1 - ratio):.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
