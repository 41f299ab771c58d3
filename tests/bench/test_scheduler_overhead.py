"""The scheduler-overhead benchmark runs and measures what it claims (not how fast)."""

from bench.scheduler_overhead import format_table, measure


def test_benchmark_measures_pure_decode_steps_with_a_full_waiting_queue() -> None:
    row = measure(num_running=16, steps=5)
    assert row.running == 16
    assert 0 < row.plan_median_us <= row.plan_p99_us
    assert 0 < row.update_median_us <= row.update_p99_us
    # A continuing decode travels as its id and a token count, not its conversation.
    assert row.bytes_per_request < 32
    assert "| 16 |" in format_table([row])
