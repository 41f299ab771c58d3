"""The throughput benchmark runs both systems end to end and compares like with like (not how
fast: a tiny model on a shared machine says nothing about speed)."""

import json
from pathlib import Path

from bench.throughput import format_table, run_benchmark
from bench.throughput_peer import run_transformers
from bench.throughput_workload import BenchConfig
from tests.helpers.model_factory import build_model


def test_benchmark_measures_both_systems_and_their_outputs_agree() -> None:
    config = BenchConfig(
        requests=4, new_tokens=8, min_prompt=8, max_prompt=32, hidden=64, layers=2, vocab=1024, threads=1
    )
    result = run_benchmark(config)
    for system in (result.splitserve, result.transformers):
        assert system.tokens_per_s > 0
        assert system.output_tokens == 4 * 8
        assert all(0 < t <= system.wall_s for t in system.ttft_s)
    assert result.matching == 4
    assert "ratio to transformers" in format_table(result)


def test_the_transformers_peer_runs_plain_greedy_whatever_the_folders_generation_defaults(tmp_path: Path) -> None:
    # SmolLM2 ships repetition_penalty 1.1 (with sampling defaults generate ignores when greedy);
    # generate() applied the penalty, and the peer's tokens left every other system's.
    # A vocabulary of 32: within 24 tokens the greedy choice meets tokens already in the row.
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 32}
    plain = build_model("llama", tmp_path / "plain", seed=3, **shape)
    penalised = build_model("llama", tmp_path / "penalised", seed=3, **shape)
    defaults = json.loads((penalised / "generation_config.json").read_text())
    defaults.update(repetition_penalty=3.0, do_sample=True, temperature=0.2, top_p=0.9)
    (penalised / "generation_config.json").write_text(json.dumps(defaults))
    prompts = [[5, 9, 5, 9, 5, 9, 5], [17, 3, 17, 3]]
    expected = run_transformers(plain, prompts, [24, 24], threads=1).outputs
    assert run_transformers(penalised, prompts, [24, 24], threads=1).outputs == expected
