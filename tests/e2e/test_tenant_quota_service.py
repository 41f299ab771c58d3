"""Tenants' quotas and their administration through real processes (a scheduler over the
simulated executor, whose steps take a fixed time): a tenant past max_running and max_waiting is
refused with RESOURCE_EXHAUSTED and a retry-after while another tenant's requests run as if it
were not there; max_running with room in max_waiting holds the extra request until one of the
tenant's own ends; tokens_per_minute refuses with retry-after; a keyed client's tenant is its
key's whatever x-splitserve-tenant says; Admin/GetTenants and Admin/ReloadTenants (new limits
without a restart, a broken file refused with the old limits kept); and the tenant and the
retry-after across the front-end -> planner hop (--frontends 2)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from protos.splitserve.v1 import admin_pb2, admin_pb2_grpc
from tests.helpers.generate_calls import (
    GenerateCall,
    Outcome,
    call_metadata,
    generate,
    token_request,
)
from tests.helpers.metrics_scrape import scrape
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import free_port
from tests.helpers.sim_executor_process import start_sim_executor

STEP_MS = 20
# Long enough (LONG x STEP_MS = 20 s) to be running still when the test is done with it; the
# test cancels it.
LONG = 1000
SHORT = 8
KEYS = {tenant: f"key-of-tenant-{tenant}-0123456789" for tenant in ("a", "b", "c", "h", "t")}
ADMIN_KEY = "admin-key-for-the-tests-0123456789"
TENANTS = """
[tenants.a]
max_running = 2
max_waiting = 0

[tenants.c]
max_running = 2
max_waiting = 0

[tenants.h]
max_running = 1
max_waiting = 4

[tenants.t]
tokens_per_minute = 100
"""


@dataclass(slots=True, frozen=True)
class Served:
    address: str
    metrics_port: int


def _write_keys(folder: Path, keys: dict[str, str]) -> tuple[Path, Path]:
    client_keys, admin_keys = folder / "api-keys", folder / "admin-keys"
    client_keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in keys.items()))
    admin_keys.write_text(f"{ADMIN_KEY}\n")
    return client_keys, admin_keys


@pytest.fixture
def executor() -> Iterator[str]:
    """An executor of its own for a test that starts a scheduler (one scheduler holds one)."""
    with start_sim_executor(STEP_MS) as address:
        yield address


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The scheduler the module's quota tests share, each with tenants of its own."""
    folder = tmp_path_factory.mktemp("tenant-quotas")
    tenants = folder / "tenants.toml"
    tenants.write_text(TENANTS)
    client_keys, admin_keys = _write_keys(folder, KEYS)
    metrics_port = free_port()
    with start_sim_executor(STEP_MS) as executor, start_scheduler(
        executor, policy="fair", tenants_file=tenants, api_key_file=client_keys,
        admin_key_file=admin_keys, metrics_port=metrics_port,
    ) as address:
        yield Served(address, metrics_port)


def _admin(channel: grpc.aio.Channel) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(channel)


async def _tenants(channel: grpc.aio.Channel) -> dict[str, admin_pb2.TenantStatus]:
    report = await _admin(channel).GetTenants(admin_pb2.GetTenantsRequest(), metadata=call_metadata(ADMIN_KEY))
    return {status.name: status for status in report.tenants}


def _assert_refused_with_retry_after(outcome: Outcome, *named: str) -> int:
    assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
    assert not outcome.token_ids
    for word in named:
        assert word in outcome.details, outcome.details
    assert outcome.retry_after is not None and outcome.retry_after.isdigit(), outcome
    assert int(outcome.retry_after) >= 1
    return int(outcome.retry_after)


async def _running(channel: grpc.aio.Channel, count: int, key: str, tenant: str | None = None) -> list[GenerateCall]:
    """count long requests of a key, each started (its first token came)."""
    calls = [GenerateCall(channel, token_request(LONG), key, tenant) for _ in range(count)]
    for call in calls:
        await call.started()
    return calls


async def _end(calls: list[GenerateCall]) -> None:
    for call in calls:
        call.cancel()
    for call in calls:
        await call.outcome()


def test_a_tenant_past_its_quota_is_refused_with_retry_after_while_another_runs(served: Served) -> None:
    # Counted from here: the module's other tests share the scheduler (and send as b).
    before, _ = scrape(served.metrics_port)

    async def scenario() -> tuple[Outcome, list[Outcome], dict[str, admin_pb2.TenantStatus]]:
        async with grpc.aio.insecure_channel(served.address) as channel:
            running = await _running(channel, 2, KEYS["a"])
            refused = await generate(channel, token_request(SHORT), KEYS["a"])
            # b meanwhile: several at once, each starting and finishing.
            b_calls = [GenerateCall(channel, token_request(SHORT, prompt=(20 + i, 21)), KEYS["b"]) for i in range(3)]
            b_outcomes = [await call.outcome() for call in b_calls]
            tenants = await _tenants(channel)
            assert not any(call.done for call in running), "a's long requests ended before the test did"
            await _end(running)
        return refused, b_outcomes, tenants

    refused, b_outcomes, tenants = asyncio.run(scenario())
    _assert_refused_with_retry_after(refused, "tenant 'a'", "max_running", "max_waiting")
    for outcome in b_outcomes:
        assert outcome.code == grpc.StatusCode.OK, outcome
        assert len(outcome.token_ids) == SHORT
        # b never waited for a's quota: its first token within a few steps of a 20 s request's.
        assert outcome.ttft_s is not None and outcome.ttft_s < LONG * STEP_MS / 1000 / 4
    a = tenants["a"]
    assert (a.max_running, a.max_waiting, a.num_running, a.num_waiting, a.configured) == (2, 0, 2, 0, True)
    assert tenants["b"].num_running == 0 and not tenants["b"].configured

    after, _ = scrape(served.metrics_port)

    def counted(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert counted('splitserve:tenant_requests_refused_total{reason="max_waiting",tenant="a"}') == 1
    assert not any(key.startswith("splitserve:tenant_requests_refused_total") and 'tenant="b"' in key for key in after)
    assert counted('splitserve:tenant_generation_tokens_total{tenant="b"}') == 3 * SHORT


def test_max_running_holds_the_extra_request_until_one_of_the_tenants_ends(served: Served) -> None:
    first_tokens = 40

    async def scenario() -> tuple[int, Outcome, Outcome, admin_pb2.TenantStatus]:
        async with grpc.aio.insecure_channel(served.address) as channel:
            first = GenerateCall(channel, token_request(first_tokens), KEYS["h"])
            await first.started()
            second = GenerateCall(channel, token_request(SHORT, prompt=(30, 31)), KEYS["h"])
            while (held := (await _tenants(channel))["h"]).num_waiting < 1:
                assert not first.done, "h's first request ended before the second was held"
                await asyncio.sleep(0.01)
            await second.started()
            # What the first had when the second's first token came (one channel: in order).
            first_had = first.tokens_received
            return first_had, await first.outcome(), await second.outcome(), held

    first_had, first, second, held = asyncio.run(scenario())
    assert (held.max_running, held.max_waiting, held.num_running, held.num_waiting) == (1, 4, 1, 1)
    assert first_had == first_tokens, f"the held request started while the first had {first_had} tokens"
    assert first.code == grpc.StatusCode.OK and len(first.token_ids) == first_tokens
    assert second.code == grpc.StatusCode.OK and len(second.token_ids) == SHORT


def test_tokens_per_minute_refuses_with_retry_after(served: Served) -> None:
    async def scenario() -> tuple[Outcome, Outcome, Outcome]:
        async with grpc.aio.insecure_channel(served.address) as channel:
            # 4 prompt tokens + 60: 64 of t's 100 a minute.
            within = await generate(channel, token_request(60), KEYS["t"])
            past = await generate(channel, token_request(60), KEYS["t"])
            never = await generate(channel, token_request(200), KEYS["t"])
        return within, past, never

    within, past, never = asyncio.run(scenario())
    assert within.code == grpc.StatusCode.OK and len(within.token_ids) == 60
    # The first request's 64 tokens leave the window a minute after it was asked for.
    retry = _assert_refused_with_retry_after(past, "tenant 't'", "tokens_per_minute")
    assert 30 <= retry <= 60
    # Larger than the whole quota: no wait makes it fit, so not a code clients retry, and no
    # retry-after.
    assert never.code == grpc.StatusCode.FAILED_PRECONDITION and never.retry_after is None, never
    assert "tokens_per_minute" in never.details and "max_tokens" in never.details


def test_a_keyed_client_cannot_name_another_tenant(served: Served) -> None:
    async def scenario() -> tuple[Outcome, Outcome, dict[str, admin_pb2.TenantStatus]]:
        async with grpc.aio.insecure_channel(served.address) as channel:
            running = await _running(channel, 2, KEYS["c"], tenant="b")
            # c's key naming b still counts for c, whose quota is full.
            posing = await generate(channel, token_request(SHORT), KEYS["c"], tenant="b")
            # b's key naming c runs as b, untouched by c's quota.
            as_b = await generate(channel, token_request(SHORT), KEYS["b"], tenant="c")
            tenants = await _tenants(channel)
            await _end(running)
        return posing, as_b, tenants

    posing, as_b, tenants = asyncio.run(scenario())
    _assert_refused_with_retry_after(posing, "tenant 'c'")
    assert as_b.code == grpc.StatusCode.OK and len(as_b.token_ids) == SHORT
    assert tenants["c"].num_running == 2
    # c's refusal counted as c's, the only one of the module's tests c sends.
    samples, _ = scrape(served.metrics_port)
    assert samples['splitserve:tenant_requests_refused_total{reason="max_waiting",tenant="c"}'] == 1


def test_admin_takes_only_admin_keys(served: Served) -> None:
    async def scenario() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(served.address) as channel:
            try:
                await _admin(channel).GetTenants(admin_pb2.GetTenantsRequest(), metadata=call_metadata(KEYS["a"]))
            except grpc.aio.AioRpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    assert asyncio.run(scenario()) == grpc.StatusCode.UNAUTHENTICATED


def _tenants_file_and_keys(folder: Path, tenants: str) -> dict[str, object]:
    """The scheduler flags of a tenants file and key files (every tenant of KEYS keyed)."""
    path = folder / "tenants.toml"
    path.write_text(tenants)
    client_keys, admin_keys = _write_keys(folder, KEYS)
    return {"tenants_file": path, "api_key_file": client_keys, "admin_key_file": admin_keys}


async def _reload(channel: grpc.aio.Channel) -> admin_pb2.TenantsReport:
    return await _admin(channel).ReloadTenants(admin_pb2.ReloadTenantsRequest(), metadata=call_metadata(ADMIN_KEY))


def test_reloaded_tenants_apply_without_a_restart_and_a_broken_file_keeps_them(executor: str, tmp_path: Path) -> None:
    flags = _tenants_file_and_keys(tmp_path, "[tenants.a]\nmax_running = 1\nmax_waiting = 0\n")
    tenants_file = flags["tenants_file"]
    assert isinstance(tenants_file, Path)

    async def scenario(address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            before = (await _tenants(channel))["a"]
            assert (before.max_running, before.max_waiting, before.configured) == (1, 0, True)
            running = await _running(channel, 1, KEYS["a"])
            _assert_refused_with_retry_after(await generate(channel, token_request(SHORT), KEYS["a"]), "tenant 'a'")

            tenants_file.write_text("[tenants.a]\nmax_running = 2\nmax_waiting = 0\nweight = 3\n")
            report = await _reload(channel)
            [reloaded] = [status for status in report.tenants if status.name == "a"]
            assert (reloaded.max_running, reloaded.weight, reloaded.num_running) == (2, 3.0, 1)
            assert report.source == str(tenants_file)
            # Admitted now, beside the first (which still runs).
            running += await _running(channel, 1, KEYS["a"])

            tenants_file.write_text("[tenants.a]\nmax_running = -1\n")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _reload(channel)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_running" in (refused.value.details() or "")
            kept = (await _tenants(channel))["a"]
            assert (kept.max_running, kept.max_waiting, kept.weight, kept.num_running) == (2, 0, 3.0, 2)
            # The limits kept are enforced: a third is refused (the defaults would have no limit).
            _assert_refused_with_retry_after(await generate(channel, token_request(SHORT), KEYS["a"]), "tenant 'a'")
            assert not any(call.done for call in running)
            await _end(running)

    with start_scheduler(executor, **flags) as address:
        asyncio.run(scenario(address))


def test_reloading_without_a_tenants_file_is_a_failed_precondition(executor: str) -> None:
    async def scenario(address: str) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _reload(channel)
            return refused.value

    with start_scheduler(executor) as address:
        error = asyncio.run(scenario(address))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--tenants-file" in (error.details() or "")


def test_the_tenant_and_the_retry_after_cross_the_front_end_to_planner_hop(executor: str, tmp_path: Path) -> None:
    metrics_port = free_port()
    flags = _tenants_file_and_keys(tmp_path, TENANTS)

    async def scenario(address: str) -> tuple[Outcome, Outcome, dict[str, admin_pb2.TenantStatus]]:
        async with grpc.aio.insecure_channel(address) as channel:
            running = await _running(channel, 2, KEYS["a"])
            refused = await generate(channel, token_request(SHORT), KEYS["a"])
            other = await generate(channel, token_request(SHORT), KEYS["b"])
            tenants = await _tenants(channel)
            await _end(running)
        return refused, other, tenants

    with start_scheduler(executor, frontends=2, metrics_port=metrics_port, **flags) as address:
        refused, other, tenants = asyncio.run(scenario(address))
        samples, _ = scrape(metrics_port)
    # The planner refused it (front-ends keep no quotas) for a's key, and the front-end passed on
    # its retry-after.
    _assert_refused_with_retry_after(refused, "tenant 'a'", "max_waiting")
    assert other.code == grpc.StatusCode.OK and len(other.token_ids) == SHORT
    assert tenants["a"].num_running == 2
    assert samples['splitserve:tenant_requests_refused_total{reason="max_waiting",tenant="a"}'] == 1
    assert samples['splitserve:tenant_generation_tokens_total{tenant="b"}'] == SHORT
