"""The scale benchmark runs real processes end to end and measures what it claims (not how
fast): simulated executors busy for their step time, clients receiving every token, and the CPU
of the scheduler's processes (one, or a planner and its front-ends, or a planner fed in packed
batches by bench.planner_load) counted per token delivered."""

import pytest

from bench.scale import ScaleConfig, format_costs, format_table, role_costs, run_once


@pytest.mark.parametrize("frontends", [pytest.param(1, marks=pytest.mark.slow), 2, 0])
def test_scale_benchmark_drives_simulated_executors_from_client_streams(frontends: int) -> None:
    config = ScaleConfig(
        executors=2, running=8, step_ms=20.0, load_processes=1, prompt_len=16, max_tokens=32,
        warmup_s=3.0, measure_s=2.0, frontends=frontends,
    )
    result = run_once(config)
    assert len(result.idle_shares) == 2 and all(0.0 <= share < 1.0 for share in result.idle_shares)
    assert result.failed_streams == 0
    # 16 streams at one token per 20 ms step at most: 800 tokens/s.
    assert result.ideal_tokens_per_s == 800
    assert 0 < result.client_tokens_per_s <= 800 * 1.1
    # Every stream delivered before the window opened; the executors sampled what clients got
    # (and, while they catch up, more).
    assert result.delivering_streams == 16
    assert result.generated_tokens_per_s > 0
    assert result.scheduler_cpu > 0 and result.scheduler_cpu_us_per_token > 0
    assert f"| 20 | 2 x 8 | {frontends} |" in format_table([result])
    roles = {cost.role: cost for cost in role_costs([result])}
    # A planner's cost per token sampled as well as per token delivered: they part where the
    # front-ends fall behind.
    per_generated = result.planner_cpu_us_per_generated_token
    if frontends == 1:
        assert result.planner_cpu_us_per_token is None and result.frontend_cpu_us_per_token is None
        assert per_generated is None
        assert list(roles) == ["scheduler"]
    else:
        assert per_generated is not None and per_generated > 0
        assert f"planner per generated token {per_generated:.1f} us" in format_costs([result])
    if frontends == 0:
        # A planner alone (bench.planner_load plays its front-ends): the tier is the planner.
        assert result.frontend_cpu_us_per_token is None
        assert result.planner_cpu_us_per_token == pytest.approx(result.scheduler_cpu_us_per_token)
        assert list(roles) == ["scheduler", "planner"]
    elif frontends > 1:
        planner, frontend = result.planner_cpu_us_per_token, result.frontend_cpu_us_per_token
        assert planner is not None and planner > 0 and frontend is not None and frontend > 0
        # The whole scheduler is its planner and its front-ends, nothing else.
        assert result.scheduler_cpu_us_per_token == pytest.approx(planner + frontend)
        assert list(roles) == ["scheduler", "planner", "front-ends"]
        assert roles["front-ends"].cores == pytest.approx(800 * frontend / 1e6)
    assert "800 tok/s asked; scheduler " in format_costs([result])
