"""Tenants and deadlines from the client library and the CLI, against a real scheduler without API
keys (so x-splitserve-tenant names the tenant) over a simulated executor: a client's tenant and
a call's own reach the scheduler's books (Admin/GetTenants, per-tenant metrics), a tenant over
its quota and a request predicted to miss its deadline are refused with RESOURCE_EXHAUSTED and
retry_after_s, and deadlines a request can meet are counted as met."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from clients import AsyncClient, Client, SplitserveError
from clients.cli import main as cli_main
from clients.request_builder import build_generate_request
from tests.helpers.metrics_scrape import scrape
from tests.helpers.tenant_stack import TenantStack, start_tenant_stack, tenants_report

# solo may run one request at a time and queue none: a second concurrent call is refused.
TENANTS = """
[tenants.solo]
max_running = 1
max_waiting = 0
"""
PROMPT = "Hello there, how are you today?"
# Far below the simulated executor's 20 ms step: no forecast can meet it.
IMPOSSIBLE_MS = 1
# Far above anything a request of a few tokens takes.
GENEROUS_MS = 600_000
# Long enough to be running still when the second call arrives (the test cancels it).
LONG = 2000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantStack]:
    with start_tenant_stack(tmp_path_factory.mktemp("client-tenants"), TENANTS) as started:
        with Client(started.scheduler, timeout=60) as client:
            # Steps enough for the scheduler's step-cost model to forecast (it judges no deadline
            # before).
            client.generate(PROMPT, max_tokens=16, ignore_eos=True)
        yield started


def generated_tokens(stack: TenantStack, tenant: str) -> float:
    samples, _ = scrape(stack.metrics_port)
    return samples.get(f'splitserve:tenant_generation_tokens_total{{tenant="{tenant}"}}', 0.0)


def slo_count(stack: TenantStack, tenant: str, slo: str, outcome: str) -> float:
    samples, _ = scrape(stack.metrics_port)
    return samples.get(f'splitserve:tenant_slo_total{{outcome="{outcome}",slo="{slo}",tenant="{tenant}"}}', 0.0)


def test_deadline_arguments_land_in_their_fields() -> None:
    request = build_generate_request(PROMPT, ttft_deadline_ms=250, tpot_target_ms=40)
    assert (request.ttft_deadline_ms, request.tpot_target_ms) == (250, 40)
    unset = build_generate_request(PROMPT)
    assert (unset.ttft_deadline_ms, unset.tpot_target_ms) == (0, 0)
    with pytest.raises(ValueError, match="ttft_deadline_ms"):
        build_generate_request(PROMPT, ttft_deadline_ms=-1)


def test_a_tenant_that_metadata_cannot_carry_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="tenant"):
        Client("127.0.0.1:1", tenant="two words")
    with Client("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match="tenant"):
            client.stream(PROMPT, tenant="caf\u00e9")


def test_the_clients_tenant_and_a_calls_own_reach_the_scheduler(stack: TenantStack) -> None:
    with Client(stack.scheduler, timeout=60, tenant="acme") as client:
        client.generate(PROMPT, max_tokens=3, ignore_eos=True)
        # The call's tenant replaces the client's for that call only.
        client.generate(PROMPT, max_tokens=5, ignore_eos=True, tenant="zeta")
        client.generate(messages=[("user", PROMPT)], max_tokens=2, ignore_eos=True)

    assert generated_tokens(stack, "acme") == 3 + 2
    assert generated_tokens(stack, "zeta") == 5
    report = tenants_report(stack.scheduler)
    # Counters are kept only while a tenant has requests placed: these are all done.
    assert report["acme"].tokens_last_minute > 0 and not report["acme"].configured
    assert report["acme"].served_tokens_per_weight == 0
    assert report["zeta"].tokens_last_minute > 0


def test_the_async_clients_tenant_reaches_the_scheduler(stack: TenantStack) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack.scheduler, timeout=60, tenant="async-team") as client:
            await client.generate(PROMPT, max_tokens=4, ignore_eos=True)
            await client.generate(PROMPT, max_tokens=2, ignore_eos=True, tenant="async-other")

    asyncio.run(scenario())
    assert generated_tokens(stack, "async-team") == 4
    assert generated_tokens(stack, "async-other") == 2


def wait_until_nothing_runs(stack: TenantStack, tenant: str) -> None:
    """Until the scheduler has released every seat of the tenant's (a cancelled call's request is
    aborted a moment after its client lets go)."""
    deadline = time.monotonic() + 60
    while tenants_report(stack.scheduler)[tenant].num_running:
        assert time.monotonic() < deadline, f"{tenant}'s requests still run"
        time.sleep(0.05)


def test_a_tenant_over_its_quota_gets_retry_after(stack: TenantStack) -> None:
    wait_until_nothing_runs(stack, "solo")
    with Client(stack.scheduler, timeout=60, tenant="solo") as client:
        with client.stream(PROMPT, max_tokens=LONG, ignore_eos=True) as running:
            next(running)
            with pytest.raises(SplitserveError) as refused:
                client.generate(PROMPT, max_tokens=3)
            # Another tenant is not held back by solo's quota.
            other = client.generate(PROMPT, max_tokens=3, ignore_eos=True, tenant="bystander")
    error = refused.value
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_running" in error.details
    assert error.retry_after_s is not None and error.retry_after_s >= 1
    assert len(other.token_ids) == 3


def test_the_async_client_sees_retry_after_on_a_quota_refusal(stack: TenantStack) -> None:
    async def scenario() -> SplitserveError:
        async with AsyncClient(stack.scheduler, timeout=60, tenant="solo") as client:
            async with client.stream(PROMPT, max_tokens=LONG, ignore_eos=True) as running:
                await anext(running)
                with pytest.raises(SplitserveError) as refused:
                    await client.generate(PROMPT, max_tokens=3)
        return refused.value

    wait_until_nothing_runs(stack, "solo")
    error = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.retry_after_s is not None and error.retry_after_s >= 1


def test_deadlines_reach_the_scheduler(stack: TenantStack) -> None:
    with Client(stack.scheduler, timeout=60, tenant="deadlines") as client:
        with pytest.raises(SplitserveError) as missed_ttft:
            client.generate(PROMPT, max_tokens=3, ttft_deadline_ms=IMPOSSIBLE_MS)
        with pytest.raises(SplitserveError) as missed_tpot:
            client.generate(PROMPT, max_tokens=3, tpot_target_ms=IMPOSSIBLE_MS)
        met = client.generate(
            PROMPT, max_tokens=4, ignore_eos=True, ttft_deadline_ms=GENEROUS_MS, tpot_target_ms=GENEROUS_MS
        )
    for refused, field in ((missed_ttft.value, "ttft_deadline_ms"), (missed_tpot.value, "target")):
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert field in refused.details
        assert refused.retry_after_s is not None and refused.retry_after_s >= 1
    assert len(met.token_ids) == 4
    assert slo_count(stack, "deadlines", "ttft", "met") == 1
    assert slo_count(stack, "deadlines", "tpot", "met") == 1


def test_an_error_without_retry_after_has_none(stack: TenantStack) -> None:
    with Client(stack.scheduler, timeout=60) as client:
        with pytest.raises(SplitserveError) as refused:
            # Metadata carries it, but it is no tenant name.
            client.generate(PROMPT, max_tokens=3, tenant="-leading-dash")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.retry_after_s is None


def test_the_cli_sends_tenant_and_deadlines(stack: TenantStack, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--server", stack.scheduler, "--timeout", "60", "--tenant", "cli-team"]
    assert cli_main([*base, "--max-tokens", "3", "--ttft-deadline-ms", str(GENEROUS_MS), PROMPT]) == 0
    assert capsys.readouterr().out.strip()
    assert generated_tokens(stack, "cli-team") == 3
    assert slo_count(stack, "cli-team", "ttft", "met") == 1

    assert cli_main([*base, "--max-tokens", "3", "--tpot-target-ms", str(IMPOSSIBLE_MS), PROMPT]) == 1
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err
