"""Two builds of the C kernels, alternated step by step in one process: step_profile's workload
planned by the real scheduler and run by the real ModelRunner, each step on this tree's kernels
or on a git revision's, taking turns, so that the machine's slow spells land on both alike.
On a host whose speed swings within minutes, this is what tells a kernel change of a few
percent from the weather.

    python -m bench.kernel_ab --base HEAD [--model DIR] [--rounds 4] [--threads 2]

The revision's executor_service/kernels/ (its .c files and headers) is built by
cpu_kernels.compile_library with the revision's own COMPILE_FLAGS, as its executor built them. Before each step, the C functions
held by the wrappers that load_panel_kernel, load_prefill_kernel, load_decode_kernel,
load_layer_kernels and load_row_argmax return are pointed at one library or the other.
Weights are packed once, by this tree's panel_pack (and panel_q4_pack), so the two builds must
agree on the packed layouts and on the C functions' signatures (the 4-bit blocks' commit added
an argument to panel_linear: a base before it cannot be compared); the greedy head's screen
keeps this tree's build. Decode steps run through the Python
layer loop, not the decode program: the program calls this tree's kernels from C, past the
wrappers.

Round r runs the whole workload with step i on the revision when i + r is even, so after two
rounds every step index has run on both sides. Prints, per kind of step (with prefill, decode
only), the mean ms of each side over step indices seen on both, and this tree's time over the
revision's.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from bench.step_profile import step_kind, workload
from bench.throughput import build_bench_model
from bench.throughput_workload import BenchConfig
from executor_service.attention.decode_kernel import load_decode_kernel
from executor_service.attention.prefill_kernel import load_prefill_kernel
from executor_service.kernels.argmax_kernel import load_row_argmax
from executor_service.kernels.cpu_kernels import (
    KERNEL_DIR,
    KernelUnavailable,
    compile_library,
)
from executor_service.kernels.layer_kernels import load_layer_kernels
from executor_service.kernels.panel_linear import load_panel_kernel
from scheduler_service.planner.plan_codec import output_from_proto, plan_to_proto

REPOSITORY = KERNEL_DIR.parents[1]
# Where a revision keeps cpu_kernels.py: beside its C files, or, before the executor's code
# moved into rooms, beside their folder.
CPU_KERNELS = (KERNEL_DIR / "cpu_kernels.py", KERNEL_DIR.with_name("cpu_kernels.py"))
SIDES = ("base", "tree")


def build_revision(revision: str, directory: Path) -> ctypes.CDLL:
    """The C kernels as `revision` has them, compiled under directory and loaded."""
    folder = KERNEL_DIR.relative_to(REPOSITORY).as_posix()
    names = git("ls-tree", "--name-only", f"{revision}:{folder}").split()
    sources = directory / "kernels"
    sources.mkdir()
    for name in names:
        (sources / name).write_text(git("show", f"{revision}:{folder}/{name}"))
    flags = compile_flags(revision_file(revision, CPU_KERNELS))
    return ctypes.CDLL(str(compile_library(sorted(sources.glob("*.c")), directory, flags=flags)))


def compile_flags(cpu_kernels_source: str) -> tuple[str, ...]:
    """The COMPILE_FLAGS a revision's cpu_kernels.py builds its kernels with: a change of flags
    is part of the kernels it compares."""
    for node in ast.parse(cpu_kernels_source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMPILE_FLAGS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise ValueError("the revision's cpu_kernels.py has no COMPILE_FLAGS")


def revision_file(revision: str, candidates: tuple[Path, ...]) -> str:
    """The text of the first of candidates that revision has."""
    names = [path.relative_to(REPOSITORY).as_posix() for path in candidates]
    listed = set(git("ls-tree", "-r", "--name-only", revision, "--", *names).split())
    for name in names:
        if name in listed:
            return git("show", f"{revision}:{name}")
    raise FileNotFoundError(f"{revision} has none of {', '.join(names)}")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPOSITORY, capture_output=True, text=True, check=True).stdout


class KernelSwitch:
    """Points the kernel wrappers' C functions at the tree's library or the base's."""

    def __init__(self, base: ctypes.CDLL) -> None:
        loaders = (load_panel_kernel, load_prefill_kernel, load_decode_kernel, load_layer_kernels, load_row_argmax)
        wrappers = []
        # Kernels this CPU cannot run (the panel kernel without AVX-512) are not in the steps
        # either, so they are left out of the comparison.
        self.unavailable: list[str] = []
        for load in loaders:
            try:
                wrappers.append(load())
            except KernelUnavailable as unavailable:
                self.unavailable.append(f"{load.__name__}: {unavailable}")
        self._functions: dict[str, list[tuple[Any, str, Any]]] = {side: [] for side in SIDES}
        # This tree's functions the revision lacks (such as panel_amx_use, a switch, before the
        # AMX path): both sides call this tree's.
        self.missing: list[str] = []
        for wrapper in wrappers:
            for attribute, function in vars(wrapper).items():
                if not isinstance(function, ctypes._CFuncPtr):
                    continue
                twin = getattr(base, function.__name__, None)
                if twin is None:
                    self.missing.append(function.__name__)
                    continue
                twin.argtypes, twin.restype = function.argtypes, function.restype
                self._functions["tree"].append((wrapper, attribute, function))
                self._functions["base"].append((wrapper, attribute, twin))

    def use(self, side: str) -> None:
        for wrapper, attribute, function in self._functions[side]:
            setattr(wrapper, attribute, function)


def run(config: BenchConfig, revision: str, rounds: int, model_dir: Path | None) -> str:
    # times[kind][step index][side]: seconds of each run of that step on that side.
    times: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    with tempfile.TemporaryDirectory(prefix="bench-kernel-ab-") as tmp:
        model_dir = model_dir or build_bench_model(config, Path(tmp) / "llama")
        base = build_revision(revision, Path(tmp))
        switch: KernelSwitch | None = None
        for round_index in range(rounds):
            runner, scheduler = workload(config, Path(tmp), model_dir, decode_program=False)
            switch = switch or KernelSwitch(base)
            step = 0
            while scheduler.has_unfinished():
                plan = scheduler.schedule()
                side = SIDES[(step + round_index) % 2]
                switch.use(side)
                message = plan_to_proto(plan)
                started = time.perf_counter()
                result = runner.execute(message)
                times[step_kind(plan)][step][side].append(time.perf_counter() - started)
                scheduler.update(output_from_proto(result))
                step += 1
        if switch is not None:
            switch.use("tree")
    lacks = switch.missing if switch is not None else []
    missing = f" ({revision} lacks {', '.join(lacks)}: this tree's on both sides)" if lacks else ""
    if switch is not None and switch.unavailable:
        missing += f" (not on this CPU: {'; '.join(switch.unavailable)})"
    lines = [
        f"kernels of this tree against {revision}'s, {rounds} rounds alternating step by step{missing}",
        "| steps | indices on both | base ms | tree ms | tree / base |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ("prefill", "decode"):
        both = [sides for sides in times[kind].values() if all(sides[side] for side in SIDES)]
        if not both:
            continue
        mean = {side: sum(sum(s[side]) / len(s[side]) for s in both) / len(both) for side in SIDES}
        lines.append(
            f"| {kind} | {len(both)} | {1000 * mean['base']:.2f} | {1000 * mean['tree']:.2f} | "
            f"{mean['tree'] / mean['base']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernels this tree's are timed against")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="a model folder instead of the random Llama")
    args = parser.parse_args()
    vocab = BenchConfig().vocab
    if args.model is not None:
        vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    config = BenchConfig(threads=args.threads, vocab=vocab)
    print(run(config, args.base, max(2, args.rounds), args.model))


if __name__ == "__main__":
    main()
