"""The scale benchmark runs real processes end to end and measures what it claims (not how
fast): simulated executors busy for their step time, clients receiving every token."""

from bench.scale import ScaleConfig, format_table, run_once


def test_scale_benchmark_drives_simulated_executors_from_client_streams() -> None:
    config = ScaleConfig(
        executors=2, running=8, step_ms=20.0, load_processes=1, prompt_len=16, max_tokens=32,
        warmup_s=3.0, measure_s=2.0,
    )
    result = run_once(config)
    assert len(result.idle_shares) == 2 and all(0.0 <= share < 1.0 for share in result.idle_shares)
    assert result.failed_streams == 0
    # 16 streams at one token per 20 ms step at most: 800 tokens/s.
    assert result.ideal_tokens_per_s == 800
    assert 0 < result.client_tokens_per_s <= 800 * 1.1
    assert result.scheduler_cpu > 0
    assert "| 20 | 2 x 8 |" in format_table([result])
