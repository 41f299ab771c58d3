"""Replay of synthesised multi-tenant traces (python -m scheduler_service.replay --synthesize):
fair queuing evens out the token throughput of tenants sending at 10:1 rates where FCFS does
not, and deadline admission keeps the requests it admits within their TTFT deadline under a
load that cannot meet every deadline, refusing the rest at arrival. All on the simulated clock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scheduler_service.replay.__main__ import main
from scheduler_service.replay.tenant_traces import Lengths, parse_tenants, synthesize

REPO = Path(__file__).resolve().parents[2]


def replay(tmp_path: Path, *argv: str) -> dict[str, dict[str, Any]]:
    """The command's JSON, its configurations by policy."""
    out = tmp_path / "replay.json"
    assert main(["--synthesize", *argv, "--json", str(out)]) == 0
    return {c["label"].split("/")[0]: c for c in json.loads(out.read_text())["configurations"]}


def test_fair_queuing_evens_out_tenants_at_10_to_1_rates_where_fcfs_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The default trace: a at 80 requests/s, b at 8, equal weights, both asking for more than
    # half the executor.
    by_policy = replay(tmp_path, "--duration-s", "10", "--policy", "fcfs,fair")
    fair, fcfs = by_policy["fair"], by_policy["fcfs"]
    assert [t["requests"] for t in fair["tenants"]] == [t["requests"] for t in fcfs["tenants"]]
    a, b = (t["requests"] for t in fair["tenants"])
    assert 8 <= a / b <= 13
    # Both tenants had requests waiting for seconds on end, and in that window fair queuing
    # served them alike; FCFS served them as they asked, ten to one.
    assert fair["backlogged_s"] > 3.0
    assert fair["jain_index"] >= 0.95
    assert fcfs["jain_index"] <= 0.8
    a_tokens, b_tokens = (t["backlogged_tokens_per_s"] for t in fair["tenants"])
    assert 0.8 <= a_tokens / b_tokens <= 1.25
    # b waits less under fair than behind a's flood under FCFS.
    assert fair["tenants"][1]["ttft_p50_s"] * 5 < fcfs["tenants"][1]["ttft_p50_s"]
    table = capsys.readouterr().out
    assert f"{fair['jain_index']:.3f} over" in table and f"{fcfs['jain_index']:.3f} over" in table


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_admitted_requests_meet_their_ttft_deadline_and_the_rest_are_refused_at_arrival(
    tmp_path: Path, policy: str
) -> None:
    # About twice what the executor serves, every request with a 1 s TTFT deadline.
    by_policy = replay(tmp_path, "a:rate=16:ttft_ms=1000,b:rate=4:ttft_ms=1000", "--policy", policy)
    total = by_policy[policy]["total"]
    assert total["rejected"] >= 0.15 * total["requests"]
    assert total["requests"] - total["rejected"] >= 0.5 * total["requests"]
    assert total["ttft_met"] >= 0.95
    assert all(t["ttft_met"] >= 0.9 for t in by_policy[policy]["tenants"])


def test_the_command_prints_a_table_per_policy_and_tenant(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scheduler_service.replay", "--synthesize", "x:rate=20:ttft_ms=3000,y:rate=2:weight=2",
         "--duration-s", "2", "--json", str(tmp_path / "r.json")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "/mixed/" in line]
    assert [(row.split("|")[1].split("/")[0].strip(), row.split("|")[2].strip()) for row in rows] == [
        (policy, tenant) for policy in ("fcfs", "priority", "fair") for tenant in ("x", "y", "all")
    ]
    assert "| TTFT met |" in done.stdout and "every tenant had requests waiting" in done.stdout
    document = json.loads((tmp_path / "r.json").read_text())
    assert [t["name"] for t in document["trace"]["tenants"]] == ["x", "y"]
    assert all(c["tenants"][1]["weight"] == 2 for c in document["configurations"])


def test_a_trace_is_reproducible_and_each_tenant_draws_its_own() -> None:
    lengths = Lengths(prompt_median=100, output_median=50, max_prompt=1000, max_output=400, sigma=1.0)
    one = synthesize(parse_tenants("a:rate=50"), 20, lengths, seed=7)
    again = synthesize(parse_tenants("a:rate=50"), 20, lengths, seed=7)
    both = synthesize(parse_tenants("a:rate=50,b:rate=5:ttft_ms=500"), 20, lengths, seed=7)
    assert one == again
    assert [r for r in both if r.tenant == "a"] == one
    assert all(r.ttft_deadline_s == 0.5 for r in both if r.tenant == "b")
    assert one != synthesize(parse_tenants("a:rate=50"), 20, lengths, seed=8)
    # Poisson at 50/s for 20 s; lengths heavy-tailed about their medians, within their caps.
    assert 900 <= len(one) <= 1100
    outputs = np.array([r.outputs for r in one])
    assert 40 <= np.median(outputs) <= 60 and np.percentile(outputs, 99) > 4 * np.median(outputs)
    assert outputs.max() <= 400 and max(r.prompt_tokens for r in one) <= 1000


@pytest.mark.parametrize("spec", ["a", "a:rate=0", "a:rate=1:speed=2", "a:rate=1,a:rate=2", "a b:rate=1", ""])
def test_a_bad_tenant_spec_is_refused_with_a_reason(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_tenants(spec)
