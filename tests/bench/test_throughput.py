"""The throughput benchmark runs both systems end to end and compares like with like (not how
fast: a tiny model on a shared machine says nothing about speed)."""

from bench.throughput import format_table, run_benchmark
from bench.throughput_workload import BenchConfig


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
