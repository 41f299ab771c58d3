"""The kernel A/B bench builds a git revision's C kernels, really runs steps on them (the
wrappers point at the revision's library while its steps run), hands the wrappers back to this
tree's build, and reports both kinds of step (not how fast: a tiny model says nothing)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from bench import kernel_ab
from bench.throughput_workload import BenchConfig
from executor_service.kernels.panel_linear import load_panel_kernel
from tests.helpers.c_kernels import load_or_skip


def test_steps_alternate_between_the_revisions_library_and_this_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    panels = load_or_skip(load_panel_kernel, cpu_flag="avx512f")
    tree_linear = panels._linear
    seen: list[str] = []
    built: list[ctypes.CDLL] = []
    original_build = kernel_ab.build_revision

    def build(revision: str, directory: Path) -> ctypes.CDLL:
        built.append(original_build(revision, directory))
        return built[-1]

    original_use = kernel_ab.KernelSwitch.use

    def use(self: kernel_ab.KernelSwitch, side: str) -> None:
        original_use(self, side)
        address = ctypes.cast(panels._linear, ctypes.c_void_p).value
        library = "base" if address == ctypes.cast(built[0].panel_linear, ctypes.c_void_p).value else "tree"
        seen.append(f"{side}:{library}")

    monkeypatch.setattr(kernel_ab, "build_revision", build)
    monkeypatch.setattr(kernel_ab.KernelSwitch, "use", use)
    config = BenchConfig(
        requests=3, new_tokens=4, min_prompt=8, max_prompt=24, hidden=64, layers=2, vocab=512, threads=1
    )
    table = kernel_ab.run(config, "HEAD", rounds=2, model_dir=None)
    assert "base:base" in seen and "tree:tree" in seen
    assert all(entry in ("base:base", "tree:tree") for entry in seen)
    assert panels._linear is tree_linear
    kinds = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith(("| prefill", "| decode"))}
    assert kinds == {"prefill", "decode"}


def test_a_revision_is_built_with_its_own_flags() -> None:
    source = 'import os\nCOMPILE_FLAGS = ("-O3", "-ffast-math")\nLINK_FLAGS = ("-shared",)\n'
    assert kernel_ab.compile_flags(source) == ("-O3", "-ffast-math")
    with pytest.raises(ValueError, match="no COMPILE_FLAGS"):
        kernel_ab.compile_flags("FLAGS = ()\n")
