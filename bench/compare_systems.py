"""One measured run of one system over one workload, each system started fresh for it (an empty
prefix cache, its own memory high-water marks), warmed up by an untimed run of the workload's
shapes with other token ids (compare_workloads.warm_up_of) in the same process, timed over the
workload itself, and stopped after:

- splitserve: an executor and the scheduler as processes (bench.throughput_splitserve), every
  request streamed at once through AsyncClient; peak RSS of both processes;
- splitserve-exact: the same with the executor on its exact path (torch's GEMM and SDPA, the
  operations transformers itself runs; no packed weights, no decode kernel);
- splitserve-eager: the same with no decode step replayed from a CUDA graph (on CUDA, what the
  graphs buy; on the CPU the same as splitserve);
- splitserve-no-weight-blocks: the same with every weight read as float32, including those made
  of 4-bit blocks (the default SmolLM2 copy's), as an ordinary checkpoint's would be read: the
  lead that generalises beyond such checkpoints;
- splitserve-target-itl: the same with the scheduler's --target-itl-ms 100 (prefill chunks cut
  to what fits 100 ms steps while requests decode): the inter-token latency's tail it buys, and
  what it costs in throughput and first tokens;
- splitserve@REV (--base-rev REV): splitserve as the git revision REV has it, both services run
  from a checkout of it, to measure a change against the code before it in the same run;
- vllm: bench.vllm_peer under the vLLM virtualenv's python, with the libraries its CPU guide
  preloads;
- transformers, transformers-cb: bench.peer_transformers in a process of its own.

Every system gets KV room for every request at its longest at once (no preemption), in blocks of
its own size (vLLM's CPU backend: 128 tokens; the others: block_size), the same step token
budget and the same CPU threads.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.compare_models import BenchModel
from bench.compare_records import Measurement, run_result_of
from bench.compare_workloads import Workload
from bench.peer_process import run_peer
from bench.process_memory import PeakRss
from bench.throughput_splitserve import drive, running_services, splitserve_label
from bench.throughput_workload import BenchConfig
from bench.vllm_preload import preload_env
from tests.helpers.service_process import REPO_ROOT, cli_flags

# Executor flags of each splitserve system.
SPLITSERVE_PATHS: dict[str, dict[str, object]] = {
    "splitserve": {},
    "splitserve-exact": {"no_packed_linear": True, "attention_backend": "sdpa"},
    "splitserve-eager": {"cuda_graph_max_batch": 0},
    "splitserve-no-weight-blocks": {"no_weight_blocks": True},
    "splitserve-target-itl": {},
}
# Scheduler flags of each splitserve system that has any.
SPLITSERVE_SCHEDULER_FLAGS: dict[str, dict[str, object]] = {
    "splitserve-target-itl": {"target_itl_ms": 100},
}
SYSTEMS = (
    "splitserve", "splitserve-exact", "splitserve-eager", "splitserve-no-weight-blocks", "splitserve-target-itl",
    "vllm", "transformers", "transformers-cb",
)
# What a run measures unless --systems says otherwise.
DEFAULT_SYSTEMS = ("splitserve", "vllm", "transformers", "transformers-cb")
# Systems whose prefix caching the shared-prefix workload also measures switched off.
PREFIX_CACHE_SWITCHABLE = ("splitserve", "vllm")
# The system name of splitserve as --base-rev REV has it: "splitserve@REV".
BASE_PREFIX = "splitserve@"
GiB = 1 << 30
# vLLM's CPU attention backend picks this block size when none is given (platforms/cpu.py);
# its KV memory is sized in these blocks.
VLLM_CPU_BLOCK_SIZE = 128


@dataclass(slots=True, frozen=True)
class Variant:
    system: str
    prefix_caching: bool = True

    @property
    def label(self) -> str:
        return self.system if self.prefix_caching else f"{self.system} (no prefix cache)"


@dataclass(slots=True, frozen=True)
class RunSettings:
    threads: int
    vllm_python: Path
    vllm_eager: bool
    # Per peer process, start included.
    timeout_s: float
    # Request files, results and logs of the peers.
    work_dir: Path
    # torch's device and dtype names, for every system but vLLM's CPU build.
    device: str = "cpu"
    dtype: str = "float32"
    # Libraries LD_PRELOADed into vLLM (bench.vllm_preload).
    vllm_preload: tuple[Path, ...] = ()
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    # --base-rev: the revision's name and its checkout, run as the system BASE_PREFIX + name.
    base: tuple[str, Path] | None = None


def variants_for(systems: list[str], workload: Workload) -> list[Variant]:
    variants: list[Variant] = []
    for system in systems:
        variants.append(Variant(system))
        if workload.name == "shared-prefix" and system in PREFIX_CACHE_SWITCHABLE:
            variants.append(Variant(system, prefix_caching=False))
    return variants


def kv_blocks(workload: Workload, block_size: int) -> int:
    """Room for every request at its longest at once, as bench.throughput_workload sizes
    splitserve's executor."""
    return len(workload.prompts) * -(-workload.longest // block_size) + 16


def measure(
    variant: Variant,
    model: BenchModel,
    workload: Workload,
    requests_file: Path,
    warm_up: Workload,
    warm_up_file: Path,
    settings: RunSettings,
    tag: str,
) -> Measurement:
    """warm_up: the untimed run first (requests_file and warm_up_file: the two as peer_io request
    files); tag names this run's files in settings.work_dir."""
    if variant.system in SPLITSERVE_PATHS or variant.system.startswith(BASE_PREFIX):
        paths = SPLITSERVE_PATHS.get(variant.system, {})
        flags = {**paths, "device": settings.device, "dtype": settings.dtype}
        tree = settings.base[1] if settings.base and variant.system == BASE_PREFIX + settings.base[0] else REPO_ROOT
        scheduler_flags = SPLITSERVE_SCHEDULER_FLAGS.get(variant.system, {})
        return measure_splitserve(model, workload, warm_up, settings, variant.prefix_caching, flags, scheduler_flags, tree)
    out = settings.work_dir / f"{tag}.result.json"
    log = settings.work_dir / f"{tag}.log"
    common = ["--model", str(model.path), "--prompts", str(requests_file), "--warmup", str(warm_up_file)]
    common += ["--out", str(out)]
    common += ["--threads", str(settings.threads)]
    if variant.system == "vllm":
        kv_tokens = kv_blocks(workload, VLLM_CPU_BLOCK_SIZE) * VLLM_CPU_BLOCK_SIZE
        kv_bytes = kv_tokens * model.kv_bytes_per_token
        command = [str(settings.vllm_python), "-m", "bench.vllm_peer", *common]
        command += ["--max-num-seqs", str(len(workload.prompts))]
        command += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
        command += ["--kv-cache-gib", f"{kv_bytes / GiB:.6f}"]
        command += ["--enable-prefix-caching"] if variant.prefix_caching else []
        command += ["--enforce-eager"] if settings.vllm_eager else []
        return run_peer(command, out, log, settings.timeout_s, preload_env(settings.vllm_preload))
    mode = "static" if variant.system == "transformers" else "batch"
    command = [sys.executable, "-m", "bench.peer_transformers", mode, *common]
    command += ["--device", settings.device, "--dtype", settings.dtype]
    command += ["--page-size", str(settings.block_size)]
    command += ["--max-batch-tokens", str(settings.max_num_batched_tokens)]
    return run_peer(command, out, log, settings.timeout_s)


def measure_splitserve(
    model: BenchModel,
    workload: Workload,
    warm_up: Workload,
    settings: RunSettings,
    prefix_caching: bool,
    executor_flags: dict[str, object],
    scheduler_flags: dict[str, object],
    tree: Path = REPO_ROOT,
) -> Measurement:
    lengths = [len(p) for p in workload.prompts]
    config = BenchConfig(
        requests=len(workload.prompts),
        new_tokens=max(workload.new_tokens),
        min_prompt=min(lengths),
        max_prompt=max(lengths),
        threads=settings.threads,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        block_size=settings.block_size,
    )
    label = splitserve_label(config) + ("" if prefix_caching else ", a cache salt per request")
    if executor_flags:
        label += ", executor " + " ".join(cli_flags(executor_flags))
    if scheduler_flags:
        label += ", scheduler " + " ".join(cli_flags(scheduler_flags))
    if tree != REPO_ROOT:
        label += f", from {tree}"
    services_started = running_services(model.path, config, executor_flags, scheduler_flags, tree=tree)
    with services_started as services, PeakRss(services.pids) as rss:
        result = asyncio.run(
            drive(
                services.address, workload.prompts, workload.new_tokens, label, prefix_caching,
                (warm_up.prompts, warm_up.new_tokens), services.cpu_roles,
            )
        )
    run = run_result_of(result, workload.prompt_tokens - result.cached_prompt_tokens)
    return Measurement(run, rss.peak_bytes, dict(rss.by_process), result.cpu_s)
