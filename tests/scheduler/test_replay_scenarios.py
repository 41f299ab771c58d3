"""The seed document's scenarios, built into scheduler_service.replay, render to PNG files whose
plotted queues are the queues the scenario tests assert step by step."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from scheduler_service.replay.__main__ import main
from scheduler_service.replay.pictures import draw
from scheduler_service.replay.scenarios import SCENARIOS, run_scenario
from tests.helpers.sched_harness import run_seed

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def harness_queues(name: str) -> tuple[list[int], list[int]]:
    """Waiting and running after each step, from the lines the seed scenario tests assert."""
    lines = run_seed(SCENARIOS[name]).lines
    waiting = [len(line.split("| W:")[1].split("|")[0].split()) for line in lines]
    running = [len(line.split("| R:")[1].split()) for line in lines]
    return waiting, running


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_scenario_renders_the_queues_its_test_asserts(name: str, tmp_path: Path) -> None:
    replayed = run_scenario(SCENARIOS[name])
    path = tmp_path / f"{name}.png"
    plotted = draw([replayed], path, name)
    assert png_size(path) == (1000, 1000)
    assert path.stat().st_size > 20_000
    waiting, running = harness_queues(name)
    assert plotted.waiting[name] == waiting
    assert plotted.running[name] == running
    assert len(waiting) == len(replayed.steps)


def test_the_preemption_scenario_plots_its_preemptions_and_a_full_cache(tmp_path: Path) -> None:
    plotted = draw([run_scenario(SCENARIOS["preemption"])], tmp_path / "p.png", "preemption")
    assert plotted.preemptions["preemption"][-1] == 2
    assert max(plotted.kv_used_pct["preemption"]) == 100.0
    # Prefill-first never mixes: a step is all prefill or all decode.
    steps = zip(plotted.prefill["preemption"], plotted.decode["preemption"], strict=True)
    assert all(prefill == 0 or decode == 0 for prefill, decode in steps)


def test_the_command_draws_a_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decode-first.png"
    assert main(["--scenario", "decode-first", "--png", str(out), "--json", str(tmp_path / "s.json")]) == 0
    assert png_size(out) == (1000, 1000)
    assert "decode-first" in capsys.readouterr().out


def test_the_step_cost_fit_recovers_a_known_cost_and_never_goes_negative() -> None:
    from scheduler_service.replay.step_cost import fit_step_cost
    from scheduler_service.replay.trace_reader import TracedPlan

    empty = (frozenset(), frozenset(), frozenset())
    exact = [TracedPlan(0.0, empty, p, d, duration_s=0.002 + 1e-5 * p + 5e-5 * d) for p, d in [(0, 8), (64, 0), (32, 4), (128, 16), (0, 32), (16, 1)]]
    cost = fit_step_cost(exact)
    assert abs(cost.overhead_s - 0.002) < 1e-9 and abs(cost.per_decode_token_s - 5e-5) < 1e-9
    assert cost.mean_abs_error_pct < 1e-6 and cost.r_squared > 0.999999
    # Decode-heavy steps that happen to be faster: the decode term is dropped, not negative.
    noisy = [TracedPlan(0.0, empty, p, d, duration_s=0.01 + 1e-4 * p - 1e-4 * d) for p, d in [(0, 8), (64, 0), (32, 4), (128, 16), (0, 32)]]
    fitted = fit_step_cost(noisy)
    assert min(fitted.overhead_s, fitted.per_prefill_token_s, fitted.per_decode_token_s) >= 0
