"""Both services' /metrics after real traffic: every metric the dashboards use moved as the
traffic says it should, and the shipped Grafana dashboard queries only metrics that exist."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from clients import AsyncClient, Client
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.greedy_client import stream_all
from tests.helpers.metrics_scrape import Samples, scrape
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import free_port

torch.set_num_threads(1)
REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "splitserve.json"
BLOCK_SIZE = 16
NUM_BLOCKS = 64
# 24 requests on one 64-token prefix, each 80 new tokens: they need more than 64 blocks at once,
# so some are preempted; all but the first find the prefix cached.
PREFIX = [100 + i for i in range(4 * BLOCK_SIZE)]
JOBS = [(PREFIX + [7 + i, 9, 11], 80) for i in range(24)]
# A request long enough (940 tokens, 59 blocks) to be running when the executor next counts.
LONG_PROMPT, LONG_TOKENS = [3] * 40, 900

@dataclass(slots=True)
class Scraped:
    executor_address: str
    # The executor's event=executor_ready log line, and the metrics port it was given.
    executor_ready_line: str
    executor_metrics_port: int
    scheduler: Samples
    executor: Samples
    executor_during: Samples
    families: set[str]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    model = build_model("llama", tmp_path_factory.mktemp("metrics") / "llama", seed=21)
    executor_metrics, scheduler_metrics = free_port(), free_port()
    executor_process = ExecutorProcess(model, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, metrics_port=executor_metrics)
    try:
        executor = executor_process.wait_ready()
        ready_line = next(line for line in executor_process.log_text().splitlines() if "event=executor_ready" in line)
        with start_scheduler(executor, max_num_batched_tokens=256, metrics_port=scheduler_metrics) as address:
            executor_during = asyncio.run(_scrape_while_running(address, executor_metrics))
            asyncio.run(stream_all(address, JOBS))
            # The executor counts its blocks in use on a step that admits or drops a request, or a
            # second after the last count.
            time.sleep(1.1)
            with Client(address) as client:
                client.generate(prompt_token_ids=[5, 6, 7], max_tokens=1)
            scheduler, scheduler_families = scrape(scheduler_metrics)
            executor_samples, executor_families = scrape(executor_metrics)
            yield Scraped(
                executor, ready_line, executor_metrics, scheduler, executor_samples, executor_during, scheduler_families | executor_families
            )
    finally:
        executor_process.close()


async def _scrape_while_running(address: str, metrics_port: int) -> Samples:
    """The executor's metrics while a long request holds blocks there."""
    loop = asyncio.get_running_loop()
    async with AsyncClient(address) as client:
        stream = client.stream(prompt_token_ids=LONG_PROMPT, max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True)
        scraped_at = 0.0
        async for _ in stream:
            if time.monotonic() - scraped_at < 0.25:
                continue
            samples, _ = await loop.run_in_executor(None, scrape, metrics_port)
            scraped_at = time.monotonic()
            if samples["splitserve:executor_kv_blocks_in_use"] > 0:
                stream.cancel()
                return samples
    raise AssertionError("the executor never reported blocks in use while a request ran")


def test_scheduler_counts_requests_tokens_and_latencies(scraped: Scraped) -> None:
    s = scraped.scheduler
    finished = len(JOBS) + 2  # the jobs, the cancelled long request and the last one
    prompt_tokens = sum(len(prompt) for prompt, _ in JOBS) + len(LONG_PROMPT) + 3
    assert s['splitserve:request_success_total{finished_reason="length"}'] == len(JOBS) + 1
    assert s['splitserve:request_success_total{finished_reason="abort"}'] == 1
    assert s["splitserve:prompt_tokens_total"] == prompt_tokens
    assert s["splitserve:prefix_cache_queries_total"] == prompt_tokens
    # Every job after the first reuses the 4 prefix blocks at least.
    assert s["splitserve:prefix_cache_hits_total"] >= (len(JOBS) - 1) * len(PREFIX) // 2
    assert s["splitserve:generation_tokens_total"] >= sum(tokens for _, tokens in JOBS) + 1
    assert s["splitserve:num_preemptions_total"] > 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens"):
        assert s[f"splitserve:{histogram}_count"] == finished, histogram
    assert s["splitserve:inter_token_latency_seconds_count"] >= sum(tokens - 1 for _, tokens in JOBS)
    assert s["splitserve:request_prompt_tokens_sum"] == prompt_tokens
    assert s["splitserve:num_requests_running"] == s["splitserve:num_requests_waiting"] == 0
    assert s["splitserve:kv_cache_usage_perc"] == 0.0
    executor = scraped.executor_address
    assert s[f'splitserve:executor_state{{executor="{executor}",state="up"}}'] == 1
    assert s[f'splitserve:executor_state{{executor="{executor}",state="down"}}'] == 0
    assert s[f'splitserve:executor_num_requests{{executor="{executor}"}}'] == 0
    assert s["splitserve:executors_up"] == 1


def test_the_executor_names_its_metrics_port_when_it_is_ready(scraped: Scraped) -> None:
    """As the scheduler's ready line does: whoever waits for the line knows where to scrape."""
    port = scraped.executor_address.rsplit(":", 1)[1]
    assert f"port={port} metrics_port={scraped.executor_metrics_port} " in scraped.executor_ready_line


def test_executor_reports_its_steps_and_kv_blocks(scraped: Scraped) -> None:
    e = scraped.executor
    steps = e["splitserve:executor_steps_total"]
    assert steps > 0
    assert e["splitserve:executor_forward_time_seconds_count"] == steps
    assert e["splitserve:executor_step_time_seconds_count"] == steps
    assert e["splitserve:executor_step_requests_count"] == steps
    # Tokens computed: every generated token but each request's last is fed back in, plus the
    # prompts less what the prefix cache saved (preempted requests compute theirs again).
    generated = scraped.scheduler["splitserve:generation_tokens_total"]
    assert e["splitserve:executor_step_tokens_sum"] >= generated
    assert e["splitserve:executor_step_failures_total"] == 0
    # No CUDA graphs on the CPU.
    assert e["splitserve:executor_graphed_steps_total"] == 0
    assert e["splitserve:executor_kv_blocks_total"] == NUM_BLOCKS
    assert scraped.executor_during["splitserve:executor_kv_blocks_in_use"] > len(LONG_PROMPT) // BLOCK_SIZE


def dashboard_metrics() -> set[str]:
    """Metric names in every query of the dashboard, histogram suffixes taken off."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    assert exprs, "the dashboard has no queries"
    names = {name for expr in exprs for name in re.findall(r"splitserve:[a-z0-9_:]+", expr)}
    return {re.sub(r"_(bucket|count|sum)$", "", name) for name in names}


def test_the_dashboard_queries_only_metrics_that_exist(scraped: Scraped) -> None:
    # Family names drop a counter's _total; queries name the sample.
    known = scraped.families | {f"{name}_total" for name in scraped.families}
    missing = dashboard_metrics() - known
    assert not missing, f"the dashboard queries metrics no service exports: {sorted(missing)}"
    # And it shows both services.
    assert any(name.startswith("splitserve:executor_forward") for name in dashboard_metrics())
    assert "splitserve:time_to_first_token_seconds" in dashboard_metrics()
