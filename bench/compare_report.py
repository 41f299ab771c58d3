"""The peer comparison's figures: per run, their medians over runs, one markdown table per (model,
workload), the JSON file and the PNG chart."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from bench.compare_records import Measurement
from bench.compare_workloads import Workload
from bench.peer_io import ItlKind
from bench.throughput_workload import CLIENT_ROLE, EXECUTOR_ROLE, SCHEDULER_ROLE

MiB = 1 << 20
REFERENCE = "transformers"  # greedy outputs are compared with its
BASELINE = "splitserve"  # ratios are to its output tok/s


@dataclass(slots=True)
class RunFigures:
    wall_s: float
    output_tok_s: float
    # Prompt and output tokens over the wall time.
    total_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float | None
    itl_p99_s: float | None
    peak_rss_mib: float
    prompt_tokens_computed: int | None
    # CPU seconds over the timed run of the executors, the scheduler and the client (the
    # benchmark's process); None for the peers, which run in one process of their own.
    executor_cpu_s: float | None = None
    scheduler_cpu_s: float | None = None
    client_cpu_s: float | None = None


@dataclass(slots=True, frozen=True)
class Mismatch:
    """A request whose greedy output differs from transformers static generate's."""

    request: int
    # The first output position where they differ.
    token: int


@dataclass(slots=True)
class SystemRow:
    label: str
    # The system's own description of what ran (mode, threads, ...); empty if it never ran.
    system: str = ""
    itl_kind: str = ItlKind.UNAVAILABLE.value
    runs: list[RunFigures] = field(default_factory=list)
    median: RunFigures | None = None
    # Greedy outputs equal to transformers static generate's, token for token (fewest over runs),
    # and the requests that differ in that run.
    matching: int | None = None
    mismatches: list[Mismatch] = field(default_factory=list)
    ratio_to_baseline: float | None = None
    # Output tok/s over splitserve's in the run of the same number. Runs are taken in turn, so
    # the two of a pair met the machine in the same state: on a shared machine whose speed drifts
    # by 10-20 % within minutes, these vary less than the medians' ratio.
    run_ratios: list[float] = field(default_factory=list)
    # Peak RSS per process in the first run.
    rss_by_process: dict[str, int] = field(default_factory=dict)
    error: str | None = None


@dataclass(slots=True)
class WorkloadReport:
    model: str
    model_description: str
    workload: str
    workload_description: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    runs: int
    threads: int
    rows: list[SystemRow]
    # Where every system ran and in what precision, e.g. "cpu, float32".
    placement: str = "cpu, float32"
    # The most output tok/s any float32 system can reach on this workload here
    # (bench.workload_floor), and the measured rates it was computed from; None where not measured.
    ceiling_tok_s: float | None = None
    ceiling_basis: str = ""


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def run_figures(measurement: Measurement, workload: Workload) -> RunFigures:
    result = measurement.result
    output_tokens = sum(len(o) for o in result.outputs)
    itl = result.itl_s
    return RunFigures(
        wall_s=result.wall_s,
        output_tok_s=output_tokens / result.wall_s,
        total_tok_s=(workload.prompt_tokens + output_tokens) / result.wall_s,
        ttft_p50_s=percentile(result.ttft_s, 50),
        ttft_p99_s=percentile(result.ttft_s, 99),
        itl_p50_s=percentile(itl, 50) if itl else None,
        itl_p99_s=percentile(itl, 99) if itl else None,
        peak_rss_mib=measurement.peak_rss_bytes / MiB,
        prompt_tokens_computed=result.prompt_tokens_computed,
        executor_cpu_s=measurement.cpu_s.get(EXECUTOR_ROLE),
        scheduler_cpu_s=measurement.cpu_s.get(SCHEDULER_ROLE),
        client_cpu_s=measurement.cpu_s.get(CLIENT_ROLE),
    )


def median_figures(runs: list[RunFigures]) -> RunFigures:
    """Each figure's median over the runs (None where any run lacks it)."""
    medians: dict[str, Any] = {}
    for f in fields(RunFigures):
        values = [getattr(run, f.name) for run in runs]
        medians[f.name] = None if any(v is None for v in values) else statistics.median(values)
    return RunFigures(**medians)


def summarize(
    label: str, measurements: list[Measurement], workload: Workload, reference: list[list[list[int]]] | None
) -> SystemRow:
    """reference: the transformers static outputs of each run (None without that system)."""
    row = SystemRow(label, measurements[0].result.system, measurements[0].result.itl_kind)
    row.runs = [run_figures(m, workload) for m in measurements]
    row.median = median_figures(row.runs)
    row.rss_by_process = measurements[0].rss_by_process
    if reference is not None:
        worst = max(
            (mismatches(m.result.outputs, outputs) for m, outputs in zip(measurements, reference, strict=True)),
            key=len,
        )
        row.matching = len(workload.prompts) - len(worst)
        row.mismatches = worst
    return row


def mismatches(outputs: list[list[int]], reference: list[list[int]]) -> list[Mismatch]:
    found = []
    for index, (ours, theirs) in enumerate(zip(outputs, reference, strict=True)):
        if ours != theirs:
            differs = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
            found.append(Mismatch(index, differs))
    return found


def set_ratios(rows: list[SystemRow]) -> None:
    base = next((r for r in rows if r.label == BASELINE and r.median is not None), None)
    if base is None or base.median is None:
        return
    for row in rows:
        if row.median is not None:
            row.ratio_to_baseline = row.median.output_tok_s / base.median.output_tok_s
            row.run_ratios = [
                run.output_tok_s / base_run.output_tok_s for run, base_run in zip(row.runs, base.runs, strict=False)
            ]


def run_ratio_cell(ratios: list[float]) -> str:
    """The run-by-run ratios' median and range, e.g. '1.04 (1.01-1.19)'."""
    if not ratios:
        return "n/a"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, fmt)


def format_table(report: WorkloadReport) -> str:
    lines = [
        f"### {report.model} / {report.workload}",
        "",
        f"{report.model_description}. {report.workload_description}: {report.prompt_tokens} prompt tokens, "
        f"{report.output_tokens} output tokens. Greedy, EOS ignored, {report.placement}, {report.threads} CPU threads; "
        f"every figure the median of {report.runs} timed run(s). Each run starts the system fresh, runs the "
        "workload's shapes with other token ids once untimed in the same process (the warm-up), then times the "
        "workload.",
        "",
        "| system | output tok/s | total tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms "
        "| peak RSS MiB | prompt tokens computed | ratio to splitserve | run-by-run ratio ‡ "
        "| share of ceiling § | greedy = transformers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    marked = False
    for row in report.rows:
        m = row.median
        if m is None:
            lines.append(f"| {row.label} | failed: {first_line(row.error)} |" + " |" * 12)
            continue
        mark = ""
        if row.itl_kind == ItlKind.REQUEST_MEAN:
            mark, marked = " †", True
        matching = "n/a" if row.matching is None else f"{row.matching}/{report.requests}"
        cells = [
            row.label,
            f"{m.output_tok_s:.1f}",
            f"{m.total_tok_s:.1f}",
            f"{m.ttft_p50_s:.2f}",
            f"{m.ttft_p99_s:.2f}",
            _num(m.itl_p50_s, ".1f", 1000) + mark,
            _num(m.itl_p99_s, ".1f", 1000) + mark,
            f"{m.peak_rss_mib:.0f}",
            _num(m.prompt_tokens_computed, ".0f"),
            _num(row.ratio_to_baseline, ".2f"),
            run_ratio_cell(row.run_ratios),
            "n/a" if report.ceiling_tok_s is None else f"{m.output_tok_s / report.ceiling_tok_s:.0%}",
            matching,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for row in report.rows:
        if row.mismatches:
            listed = ", ".join(f"request {m.request} from token {m.token}" for m in row.mismatches[:8])
            more = f" and {len(row.mismatches) - 8} more" if len(row.mismatches) > 8 else ""
            lines += ["", f"{row.label} differs from transformers: {listed}{more}."]
    lines += ["", "‡ output tok/s over splitserve's in the same run number (runs are taken in turn, so a "
              "pair shares the machine's state): median (least-most)."]
    if report.ceiling_tok_s is not None:
        lines += ["", f"§ output tok/s over the workload's ceiling here, {report.ceiling_tok_s:.0f} tok/s "
                  f"(bench.workload_floor: {report.ceiling_basis})."]
    lines += cpu_lines(report)
    if marked:
        lines += ["", "† per-request mean inter-token latency ((last - first token) / (tokens - 1), from the "
                  "engine's timestamps): vLLM's offline API gives no per-token times."]
    return "\n".join(lines)


def cpu_lines(report: WorkloadReport) -> list[str]:
    """Where splitserve's CPU went over the timed run: on a machine whose every core the
    executor's threads use, the scheduler and the client take theirs from it."""
    lines = []
    for row in report.rows:
        m = row.median
        if m is None or m.executor_cpu_s is None or m.scheduler_cpu_s is None or m.client_cpu_s is None:
            continue
        beside = m.scheduler_cpu_s + m.client_cpu_s
        lines += [
            "",
            f"¶ {row.label}: CPU seconds over the timed run (medians), executor {m.executor_cpu_s:.2f}, "
            f"scheduler {m.scheduler_cpu_s:.2f}, client {m.client_cpu_s:.2f}: scheduler and client "
            f"{beside / (report.threads * m.wall_s):.1%} of the {report.threads} threads' time "
            f"({m.wall_s:.2f} s wall).",
        ]
    return lines


def first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0][:120] if text and text.strip() else "unknown error"


def write_json(path: Path, reports: list[WorkloadReport], settings: dict[str, Any]) -> None:
    path.write_text(json.dumps({"settings": settings, "results": [asdict(r) for r in reports]}, indent=2))


def draw_png(path: Path, reports: list[WorkloadReport]) -> None:
    """Grouped bars per (model, workload): output tok/s above, TTFT p50 below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [f"{r.model.split(' ')[0]}\n{r.workload}" for r in reports]
    # Systems in table order, those of the widest table (shared-prefix's extra rows) first.
    widest = sorted(reports, key=lambda r: -len(r.rows))
    labels = list(dict.fromkeys(row.label for r in widest for row in r.rows))
    width = 0.8 / max(1, len(labels))
    positions = np.arange(len(reports))
    figure, (speed, ttft) = plt.subplots(2, 1, figsize=(max(6.0, 1.8 * len(reports)) + 3, 8), sharex=True)
    for index, label in enumerate(labels):
        speeds, ttfts = [], []
        for report in reports:
            row = next((r for r in report.rows if r.label == label and r.median is not None), None)
            speeds.append(row.median.output_tok_s if row and row.median else 0.0)
            ttfts.append(row.median.ttft_p50_s if row and row.median else 0.0)
        offset = positions - 0.4 + width * (index + 0.5)
        speed.bar(offset, speeds, width, label=label)
        ttft.bar(offset, ttfts, width, label=label)
    speed.set_ylabel("output tokens/s (median)")
    speed.set_title("Peer comparison, same machine, same run")
    speed.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ttft.set_ylabel("TTFT p50, s (median)")
    ttft.set_xticks(positions, groups)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
