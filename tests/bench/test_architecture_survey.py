"""The architecture survey's short version (the whole sweep, 196 types and about 25 minutes, is
`python -m bench.architecture_survey`, whose counts README gives): it still builds the tiny
checkpoint of a hybrid, of a latent-attention model and of a type the executor refuses, and
reports each verdict with the executor's own reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_survey_judges_each_type_with_the_executors_own_verdict(tmp_path: Path) -> None:
    out = tmp_path / "survey.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "bench.architecture_survey", "--types", "qwen3_next,deepseek_v2,gemma4_text", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    results = {row["model_type"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert results["qwen3_next"]["status"] == "served"
    assert results["deepseek_v2"]["status"] == "served"
    assert results["gemma4_text"]["status"] == "refused"
    assert "K/V of different shapes" in results["gemma4_text"]["reason"]
    assert "summary refused=1 served=2" in run.stderr
