"""bench.host_overhead drives a real in-process executor through prefill and steady decodes and
reports the host work of a decode step, the model's forward and head excluded, and the sampler's
arithmetic beside it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.host_overhead import timed
from executor_service.runner import model_runner


def test_the_command_reports_host_work_per_step_and_per_row(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    command = [sys.executable, "-m", "bench.host_overhead", "--rows", "8", "--context", "64",
               "--steps", "4", "--warmup", "1", "--runs", "2", "--json", str(out)]
    printed = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300).stdout
    figures = json.loads(out.read_text())
    assert figures["rows"] == 8 and figures["context"] == 64 and len(figures["runs"]) == 2
    assert figures["host_us_per_step"] == statistics.median(run["host_us"] for run in figures["runs"]) > 0
    assert figures["sampling_us_per_step"] == statistics.median(run["sampling_us"] for run in figures["runs"]) > 0
    assert figures["host_and_sampling_us_per_step"] > figures["host_us_per_step"]
    assert abs(figures["host_us_per_row"] * 8 - figures["host_us_per_step"]) < 1e-6
    assert "us of host work per decode step" in printed


def test_a_forward_is_timed_even_when_it_raises_and_the_runner_gets_its_own_back() -> None:
    original = model_runner.compute_logits
    spent: list[float] = []
    with timed("compute_logits", spent), pytest.raises(AttributeError):
        model_runner.compute_logits(None, None, False)
    assert model_runner.compute_logits is original
    assert len(spent) == 1 and spent[0] >= 0
