"""bench.drain_moves, small: a tiny random model, 6 streams, one run. The drained executor's
requests move with their K/V, nothing is recomputed, and every stream gets the tokens of the
same run without a drain."""

import json
from pathlib import Path

from bench.drain_moves import main


def test_a_drain_moves_its_requests_exactly(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "drain.json"
    assert main(["--model", "tiny", "--streams", "6", "--prompt-tokens", "96", "--max-tokens", "600", "--runs", "1", "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())
    assert run["exact"] is True
    assert run["recomputed_tokens"] == 0
    assert run["moves"] > 0 and run["failed_moves"] == 0 and run["bytes_moved"] > 0
    assert "GB/s over the drain" in capsys.readouterr().out
