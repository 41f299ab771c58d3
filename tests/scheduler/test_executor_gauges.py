"""Each executor's gauges are set as it steps, through children looked up once per executor;
an executor removed and added again (the same address) is exported again. The totals over
every executor are read when scraped."""

from prometheus_client import generate_latest

from scheduler_service.core.request import Request
from scheduler_service.planner.engine import Engine
from scheduler_service.planner.engine_options import EngineOptions
from scheduler_service.planner.metrics import SchedulerMetrics


def _series(metrics: SchedulerMetrics) -> set[str]:
    return {
        line.decode() for line in generate_latest(metrics.registry).splitlines() if line.startswith(b"splitserve:executor_")
    }


def test_an_executor_steps_removed_and_back() -> None:
    metrics = SchedulerMetrics()
    metrics.executor_stepped("a:1", 3, 0.25)
    metrics.executor_stepped("b:2", 5, 0.5)
    metrics.executor_stepped("a:1", 4, 0.75)
    assert _series(metrics) == {
        'splitserve:executor_num_requests{executor="a:1"} 4.0',
        'splitserve:executor_num_requests{executor="b:2"} 5.0',
        'splitserve:executor_kv_cache_usage_perc{executor="a:1"} 0.75',
        'splitserve:executor_kv_cache_usage_perc{executor="b:2"} 0.5',
    }
    metrics.executor_removed("a:1")
    assert not any('"a:1"' in line for line in _series(metrics))
    metrics.executor_stepped("a:1", 1, 0.125)
    assert 'splitserve:executor_num_requests{executor="a:1"} 1.0' in _series(metrics)
    assert 'splitserve:executor_kv_cache_usage_perc{executor="a:1"} 0.125' in _series(metrics)


def test_the_totals_are_read_when_scraped_not_at_a_step() -> None:
    """Requests waiting with no executor up (so no step happens) are counted all the same."""
    metrics = SchedulerMetrics()
    engine = Engine("test", None, EngineOptions(), metrics)
    engine.unplaced += [Request(f"r{i}", [1, 2, 3]) for i in range(3)]
    values = {
        name: metrics.registry.get_sample_value(name)
        for name in ("splitserve:num_requests_waiting", "splitserve:num_requests_running", "splitserve:kv_cache_usage_perc")
    }
    assert values == {
        "splitserve:num_requests_waiting": 3.0,
        "splitserve:num_requests_running": 0.0,
        "splitserve:kv_cache_usage_perc": 0.0,
    }
