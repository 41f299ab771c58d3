"""bench.compare runs every system on the same workload end to end and reports like with like (not
how fast: a tiny model on a shared machine says nothing about speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.compare import available_systems, parse_args
from bench.compare_report import RunFigures, SystemRow, run_ratio_cell, set_ratios
from bench.compare_workloads import FIRST_ORDINARY_ID, WorkloadSizes, build_workload, warm_up_of
from bench.peer_io import token_gaps
from bench.peer_process import run_peer
from bench.vllm_preload import preload_env, preload_paths, venv_of
from tests.helpers.service_process import REPO_ROOT

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
TINY_WORKLOADS = [
    "--requests", "4", "--min-prompt", "8", "--max-prompt", "40", "--new-tokens", "8",
    "--shared-requests", "4", "--shared-prefix", "32", "--shared-tail", "8", "--shared-new-tokens", "8",
]  # fmt: skip
TINY_LLAMA = ["--model-layers", "2", "--model-intermediate", "128", "--model-vocab", "1024"]
# The tiny Llama's width where vLLM is not among the systems (its CPU attention wants head size 64).
NARROW_HEADS = ["--model-hidden", "64", "--model-heads", "4", "--model-kv-heads", "2"]


def run_compare(tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """Runs python -m bench.compare with --runs 1 and one thread; returns its stdout and JSON."""
    completed = subprocess.run(
        [sys.executable, "-m", "bench.compare", "--runs", "1", "--threads", "1", "--out-dir", str(tmp_path), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    png = (tmp_path / "results.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > len(PNG_SIGNATURE)
    return completed.stdout, json.loads((tmp_path / "results.json").read_text())


def table_rows(stdout: str, workload: str) -> dict[str, list[str]]:
    """The markdown table under '### MODEL / workload', as label -> cells."""
    section = stdout.split(f"/ {workload}\n", 1)[1].split("###", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| system")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def rows_by_label(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["label"]: row for row in result["rows"]}


@pytest.mark.slow
def test_splitserve_and_transformers_peers_in_one_run(tmp_path: Path) -> None:
    # One workload keeps this within make test's budget: shared-prefix runs every system the
    # fixed one does, and splitserve without its prefix cache besides.
    stdout, report = run_compare(
        tmp_path,
        "--systems",
        "splitserve,transformers,transformers-cb,splitserve-exact,splitserve-no-weight-blocks,splitserve-target-itl",
        "--workloads", "shared-prefix",
        "--models", "random-llama",
        *NARROW_HEADS, *TINY_LLAMA, *TINY_WORKLOADS,
    )  # fmt: skip
    (shared,) = report["results"]
    assert shared["workload"] == "shared-prefix"
    assert set(table_rows(stdout, "shared-prefix")) == {
        "splitserve",
        "splitserve (no prefix cache)",
        "transformers",
        "transformers-cb",
        "splitserve-exact",
        "splitserve-no-weight-blocks",
        "splitserve-target-itl",
    }
    assert shared["requests"] == 4 and shared["output_tokens"] == 4 * 8
    assert "once untimed in the same process (the warm-up)" in stdout
    assert shared["ceiling_tok_s"] > 0 and "§ output tok/s over the workload's ceiling" in stdout
    share = table_rows(stdout, "shared-prefix")["splitserve"][-2]
    assert share.endswith("%") and float(share[:-1]) > 0
    # The warm-up left nothing the timed prompts could reuse: splitserve computed the shared
    # prefix at least once and every tail (a warm-up of the same ids would leave it the tails'
    # last tokens at most).
    computed = rows_by_label(shared)["splitserve"]["median"]["prompt_tokens_computed"]
    assert computed >= 32 + 4 * 8
    for row in shared["rows"]:
        assert row["error"] is None
        assert len(row["runs"]) == 1
        median = row["median"]
        assert median["output_tok_s"] > 0 and median["total_tok_s"] > median["output_tok_s"]
        assert 0 < median["ttft_p50_s"] <= median["ttft_p99_s"] <= median["wall_s"]
        assert 0 <= median["itl_p50_s"] <= median["itl_p99_s"]
        assert row["itl_kind"] == "per-token"
        assert median["peak_rss_mib"] > 50
        # Every system's greedy tokens are transformers static generate's.
        assert row["matching"] == 4, row["label"]
    shared_rows = rows_by_label(shared)
    # Where splitserve's CPU went over the timed run, each role apart; the peers run in one
    # process of their own and have no such split.
    # (/proc counts in 10 ms ticks, and this tiny run takes a few of them.)
    ours = shared_rows["splitserve"]["median"]
    assert all(ours[f"{role}_cpu_s"] >= 0 for role in ("executor", "scheduler", "client"))
    assert ours["executor_cpu_s"] + ours["scheduler_cpu_s"] > 0 and ours["client_cpu_s"] > 0
    assert shared_rows["transformers"]["median"]["scheduler_cpu_s"] is None
    assert "¶ splitserve: CPU seconds over the timed run (medians), executor " in stdout
    assert shared_rows["splitserve"]["ratio_to_baseline"] == 1.0
    assert shared_rows["splitserve"]["run_ratios"] == [1.0]
    assert len(shared_rows["transformers"]["run_ratios"]) == 1
    # The 32-token system prompt is two blocks: computed once, then served from the cache.
    assert shared_rows["splitserve"]["median"]["prompt_tokens_computed"] < shared["prompt_tokens"]
    assert shared_rows["splitserve (no prefix cache)"]["median"]["prompt_tokens_computed"] == shared["prompt_tokens"]
    assert "splitserve" in report["settings"]["systems_run"]


@pytest.mark.slow
def test_a_base_revision_runs_beside_this_tree_from_its_own_checkout(tmp_path: Path) -> None:
    stdout, report = run_compare(
        tmp_path, "--systems", "splitserve", "--base-rev", "HEAD", "--workloads", "fixed",
        "--models", "random-llama", *NARROW_HEADS, *TINY_LLAMA, *TINY_WORKLOADS,
    )  # fmt: skip
    (fixed,) = report["results"]
    rows = rows_by_label(fixed)
    assert set(rows) == {"splitserve", "splitserve@HEAD"}
    assert all(row["error"] is None and row["median"]["output_tok_s"] > 0 for row in rows.values())
    # Served from a worktree that is gone again once the run is over.
    assert "from /" in rows["splitserve@HEAD"]["system"]
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO_ROOT, capture_output=True, text=True).stdout
    assert "bench-compare-base-" not in worktrees


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no .venv-vllm (make bench-setup-vllm)")
def test_vllm_peer_agrees_with_transformers(tmp_path: Path) -> None:
    stdout, report = run_compare(
        tmp_path,
        "--systems", "vllm,transformers",
        "--workloads", "fixed",
        "--models", "random-llama",
        "--vllm-eager", "--require-vllm",
        # vLLM's CPU attention wants a usual head size (64).
        "--model-hidden", "128", "--model-heads", "2", "--model-kv-heads", "1",
        *TINY_LLAMA, *TINY_WORKLOADS,
    )  # fmt: skip
    assert set(table_rows(stdout, "fixed")) == {"vllm", "transformers"}
    vllm = rows_by_label(report["results"][0])["vllm"]
    assert vllm["error"] is None
    assert vllm["matching"] == 4
    assert vllm["itl_kind"] == "per-request mean"
    assert vllm["median"]["ttft_p50_s"] > 0
    assert vllm["median"]["prompt_tokens_computed"] == report["results"][0]["prompt_tokens"]
    # It ran with what vLLM's CPU guide preloads, which bench/vllm_setup.sh put in its virtualenv.
    assert vllm["system"].endswith("LD_PRELOAD libtcmalloc_minimal.so.4 libiomp5.so)")
    assert "†" in stdout


def test_vllm_is_skipped_when_its_virtualenv_is_absent(tmp_path: Path) -> None:
    args = parse_args(["--systems", "splitserve,vllm", "--vllm-python", str(tmp_path / "python")])
    assert available_systems(args) == ["splitserve"]
    with pytest.raises(SystemExit, match="vllm"):
        available_systems(parse_args(["--systems", "vllm", "--vllm-python", str(tmp_path / "python"), "--require-vllm"]))


def fake_vllm_venv(root: Path, libraries: list[str]) -> Path:
    """A virtualenv layout holding only what the preload check looks at; returns its python."""
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "bin" / "python").touch()
    for name in libraries:
        (root / "lib" / name).touch()
    return root / "bin" / "python"


def test_vllm_preloads_come_from_its_virtualenv_and_a_missing_one_is_refused_before_any_run(tmp_path: Path) -> None:
    python = fake_vllm_venv(tmp_path / "venv", ["libiomp5.so"])
    with pytest.raises(SystemExit, match="tcmalloc is not in .*vllm_setup.sh"):
        available_systems(parse_args(["--systems", "splitserve,vllm", "--vllm-python", str(python)]))
    for preload in ("iomp", "none"):
        args = parse_args(["--systems", "splitserve,vllm", "--vllm-python", str(python), "--vllm-preload", preload])
        assert available_systems(args) == ["splitserve", "vllm"]

    (tmp_path / "venv" / "lib" / "libtcmalloc_minimal.so.4").touch()
    args = parse_args(["--systems", "vllm", "--vllm-python", str(python)])
    assert args.vllm_preload == ("tcmalloc", "iomp")
    paths = preload_paths(venv_of(python), args.vllm_preload)
    assert [p.name for p in paths] == ["libtcmalloc_minimal.so.4", "libiomp5.so"]
    with pytest.raises(SystemExit):
        parse_args(["--vllm-preload", "jemalloc"])


@pytest.mark.parametrize("preload", [(), ("a.so", "b.so")])
def test_the_peer_runs_with_exactly_the_preloads_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preload: tuple[str, ...]
) -> None:
    # Whatever the caller preloads does not leak into a run that asked for none.
    monkeypatch.setenv("LD_PRELOAD", "")
    paths = tuple(tmp_path / name for name in preload)
    for path in paths:
        path.touch()
    out = tmp_path / "result.json"
    record_env = (
        "import os, sys, pathlib; from bench.peer_io import RunResult, write_result; "
        "write_result(pathlib.Path(sys.argv[1]), RunResult(os.environ['LD_PRELOAD'], 1.0, [], [], [], 'none', None))"
    )
    # ld.so warns about, and skips, preloads that are not real libraries; the run goes on.
    measured = run_peer([sys.executable, "-c", record_env, str(out)], out, tmp_path / "log", 60, preload_env(paths))
    assert measured.result.system == ":".join(str(p) for p in paths)


def test_vllm_cannot_be_asked_for_off_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--systems", "splitserve,vllm", "--device", "cuda"])
    assert "vLLM's CPU build" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_peers_on_cuda_with_and_without_decode_graphs(tmp_path: Path) -> None:
    stdout, report = run_compare(
        tmp_path,
        "--systems", "splitserve,splitserve-eager,transformers,transformers-cb",
        "--workloads", "fixed",
        "--models", "random-llama",
        "--device", "cuda", "--dtype", "float32",
        *NARROW_HEADS, *TINY_LLAMA, *TINY_WORKLOADS,
    )  # fmt: skip
    assert "cuda, float32" in stdout
    (fixed,) = report["results"]
    for row in fixed["rows"]:
        assert row["error"] is None, row["label"]
        assert row["matching"] == 4, row["label"]


def test_workloads_are_deterministic_and_shaped_as_asked() -> None:
    sizes = WorkloadSizes(requests=6, min_prompt=5, max_prompt=9, shared_requests=5, shared_prefix=12, shared_tail=3)
    fixed = build_workload("fixed", sizes, vocab=100)
    assert fixed == build_workload("fixed", sizes, vocab=100)
    assert all(5 <= len(p) <= 9 and min(p) >= 3 and max(p) < 100 for p in fixed.prompts)
    varied = build_workload("varied", sizes, vocab=100)
    assert varied.prompts == fixed.prompts
    assert all(16 <= n <= 256 for n in varied.new_tokens)
    shared = build_workload("shared-prefix", sizes, vocab=100)
    assert len(shared.prompts) == 5 and all(len(p) == 15 for p in shared.prompts)
    assert len({tuple(p[:12]) for p in shared.prompts}) == 1
    assert len({tuple(p[12:]) for p in shared.prompts}) == 5


@pytest.mark.parametrize("name", ["fixed", "varied", "shared-prefix"])
def test_the_warm_up_has_the_workloads_shapes_and_shares_no_token_with_it(name: str) -> None:
    sizes = WorkloadSizes(requests=6, min_prompt=5, max_prompt=40, shared_requests=5, shared_prefix=32, shared_tail=3)
    workload = build_workload(name, sizes, vocab=100)
    warm = warm_up_of(workload, vocab=100)
    assert [len(p) for p in warm.prompts] == [len(p) for p in workload.prompts]
    assert warm.new_tokens == workload.new_tokens
    for warm_prompt, prompt in zip(warm.prompts, workload.prompts, strict=True):
        assert all(FIRST_ORDINARY_ID <= t < 100 for t in warm_prompt)
        # No position holds the timed prompt's token: no block of it can come from a prefix cache.
        assert all(w != t for w, t in zip(warm_prompt, prompt, strict=True))
    # Prompts that share a prefix in the workload share it in the warm-up.
    same_start = [p[:32] == workload.prompts[0][:32] for p in workload.prompts]
    assert [p[:32] == warm.prompts[0][:32] for p in warm.prompts] == same_start


def test_token_gaps_split_a_shared_arrival_evenly() -> None:
    # Two tokens in the first delta, then one, then three arriving together.
    assert token_gaps([1.0, 1.0, 1.5, 2.1, 2.1, 2.1]) == pytest.approx([0.0, 0.5, 0.2, 0.2, 0.2])
    assert token_gaps([0.3]) == []


def _row(label: str, tokens_per_s: list[float]) -> SystemRow:
    runs = [RunFigures(1.0, t, t, 0.1, 0.2, None, None, 100.0, None) for t in tokens_per_s]
    median = RunFigures(1.0, sorted(tokens_per_s)[len(tokens_per_s) // 2], 0.0, 0.1, 0.2, None, None, 100.0, None)
    return SystemRow(label, runs=runs, median=median)


def test_run_by_run_ratios_pair_the_runs_taken_together() -> None:
    # A slow spell in run 2 slows both systems; the medians' ratio mixes runs of different
    # spells, the run-by-run ratios do not.
    ours, theirs = _row("splitserve", [600.0, 400.0, 550.0]), _row("vllm", [500.0, 420.0, 600.0])
    failed = SystemRow("transformers", error="it broke")
    set_ratios([ours, theirs, failed])
    assert theirs.ratio_to_baseline == pytest.approx(500 / 550)
    assert theirs.run_ratios == pytest.approx([500 / 600, 420 / 400, 600 / 550])
    assert run_ratio_cell(theirs.run_ratios) == "1.05 (0.83-1.09)"
    assert ours.run_ratios == [1.0, 1.0, 1.0]
    assert failed.run_ratios == [] and run_ratio_cell(failed.run_ratios) == "n/a"
