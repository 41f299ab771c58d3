"""A step's inter-token latencies go into the histogram together (BatchHistogram.observe_all):
the exposition must be what one observe() per value gives, bucket bounds included."""

from prometheus_client import CollectorRegistry, generate_latest

from scheduler_service.planner.metrics import TOKEN_LATENCY_BUCKETS, BatchHistogram

# Below the first bound, on bounds (le: a value equal to a bound is in that bound's bucket),
# between bounds, past the last finite bound, and repeats.
VALUES = [0.0, 0.0004, 0.001, 0.001, 0.0025, 0.003, 0.02, 0.02, 0.02, 0.1, 4.99, 5.0, 7.5, 1e9]


def _exposition(observe: str, values: list[float]) -> bytes:
    registry = CollectorRegistry()
    histogram = BatchHistogram("gap_seconds", "gaps", buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
    if observe == "all":
        histogram.observe_all(values[: len(values) // 2])
        histogram.observe_all(values[len(values) // 2 :])
    else:
        for value in values:
            histogram.observe(value)
    return b"\n".join(line for line in generate_latest(registry).splitlines() if not line.startswith(b"gap_seconds_created"))


def test_observe_all_counts_every_value_in_the_bucket_observe_puts_it_in() -> None:
    assert _exposition("all", VALUES) == _exposition("one by one", VALUES)
    assert b'gap_seconds_bucket{le="0.001"} 4.0' in _exposition("all", VALUES)
    assert b"gap_seconds_count 14.0" in _exposition("all", VALUES)


def test_observe_all_of_nothing_changes_nothing() -> None:
    assert _exposition("all", []) == _exposition("one by one", [])
