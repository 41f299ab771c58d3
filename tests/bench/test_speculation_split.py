"""bench.speculation_split, small: SmolLM2-135M in process, 4 quote requests. With ngram drafts
the outputs equal those without, most drafts are accepted, fewer steps run, and both kinds of
step are timed (no assertion on the times: they are the bench's to report)."""

import json
from pathlib import Path

from bench.speculation_split import main


def test_drafts_shorten_the_decode_steps_and_change_no_output(prepared_model: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "split.json"
    assert main(["--model", str(prepared_model), "--requests", "4", "--max-tokens", "48", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    off, ngram = report["off"], report["ngram"]
    assert report["identical"] is True and off["output_tokens"] == ngram["output_tokens"] > 0
    assert off["drafted"] == 0 and ngram["accepted"] > ngram["drafted"] / 2 > 0
    assert ngram["steps"] < off["steps"]
    assert off["prefill_s"] > 0 and off["decode_s"] > 0
    assert "| ngram K=4 |" in capsys.readouterr().out
