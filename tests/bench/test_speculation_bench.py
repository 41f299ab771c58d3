"""bench.speculation, small: SmolLM2-135M, 4 quote requests, one run. With ngram drafts the
outputs equal those without, most drafts are accepted (the answer is in the prompt); with the
draft method (the model's first 8 layers proposing) the outputs equal those without too; the
block books agree after every pass."""

import json
from pathlib import Path

from bench.speculation import main


def test_ngram_and_draft_model_drafts_on_quotes_change_no_output(prepared_model: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "speculation.json"
    assert main([
        "--model", str(prepared_model), "--workloads", "quote", "--requests", "4", "--max-tokens", "48",
        "--runs", "1", "--json", str(out),
    ]) == 0
    report = json.loads(out.read_text())
    rows = {row["method"]: row for row in report["rows"]}
    assert rows["ngram"]["identical_to_off"] is True
    assert rows["ngram"]["acceptance"] > 0.5 and rows["ngram"]["accepted_per_verify"] > 1
    assert rows["off"]["acceptance"] == 0
    assert rows["draft"]["identical_to_off"] is True
    assert all(p["drafted"] > 0 for p in report["passes"] if p["method"] == "draft")
    assert all(row["audit_clean"] for row in rows.values())
    assert "| quote | ngram |" in capsys.readouterr().out
