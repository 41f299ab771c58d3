"""The disaggregation benchmark runs both configurations through real processes and reports what
it claims (not how fast): K/V moved between A's executors and none lost, client-side gaps and
times to first token for both configurations, and every request it sent completed."""

import json
import math
from pathlib import Path

import pytest

from bench.disaggregation import main


def test_disaggregation_benchmark_reports_moves_and_latencies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    main([
        "--model", "tiny", "--steady-streams", "3", "--steady-max-tokens", "48", "--long-prompt-tokens", "200",
        "--arrival-s", "1", "--duration-s", "2", "--transfer-requests", "2", "--runs", "1", "--json", str(out),
    ])
    report = json.loads(out.read_text())
    assert report["cpu_cores"] > 0 and report["runs"] == 1
    for transfer in (report["transfer_alone"], report["transfer_during_load"]):
        assert transfer["moves"] > 0 and transfer["failed_moves"] == 0
        assert transfer["gb_per_s"] > 0 and transfer["executor_gb_per_s"] > 0
        # The tiny Llama's K/V: 2 (K and V) x 2 layers x 2 KV heads x 16 dims x 4 bytes a token,
        # moved in whole 16-token blocks (200 tokens: 13 blocks).
        assert transfer["mb_per_move"] * 1e6 == pytest.approx(13 * 16 * 512)
        assert transfer["kb_per_token"] * 1e3 == pytest.approx(13 * 16 * 512 / 200)
    # Two long prompts moved one by one; two arrived during the load, each moved once.
    assert report["transfer_alone"]["moves"] == 2 and report["transfer_during_load"]["moves"] == 2
    configurations = [latency["configuration"][0] for latency in report["latency"]]
    assert configurations == ["A", "B"]
    for latency in report["latency"]:
        assert latency["completed"] == latency["sent"] > 0
        assert latency["long_prompts"] == 2
        assert 0 < latency["steady_gap_p50_ms"] <= latency["steady_gap_p99_ms"] <= latency["steady_gap_max_ms"]
        assert 0 < latency["long_ttft_p50_s"] <= latency["long_ttft_p99_s"]
        assert latency["steady_tokens_per_s"] > 0 and not math.isnan(latency["steady_tokens_per_s"])
    table = capsys.readouterr().out
    assert f"{report['cpu_cores']} CPU cores shared by both executors" in table
    assert "| A: 1 prefill + 1 decode executor |" in table and "| B: 2 mixed (both) executors |" in table
