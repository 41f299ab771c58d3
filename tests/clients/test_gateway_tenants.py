"""Tenants and deadlines through the OpenAI-compatible gateway, driven by the `openai` package,
against real processes: a simulated executor, a scheduler with tenants (one whose quota is one
request at a time), API keys (a tenant's own, and a `*` key that lets a call name its tenant)
and a metrics port, and the gateway in front. The x-splitserve-tenant header and extra_body's
ttft_deadline_ms / tpot_target_ms reach the scheduler (its per-tenant metrics count them), and
its refusals for now come back as 429 with Retry-After."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from clients import Client
from clients.openai_gateway.schemas import ChatCompletionRequest
from clients.openai_gateway.translate import chat_call
from clients.request_builder import build_generate_request
from tests.helpers.gateway_process import start_gateway
from tests.helpers.metrics_scrape import scrape
from tests.helpers.tenant_stack import TenantStack, start_tenant_stack

TENANTS = """
[tenants.solo]
max_running = 1
max_waiting = 0
"""
# A trusted front's key: its calls name their tenant in x-splitserve-tenant.
FRONT_KEY = "front-key-0123456789abcdef"
# A key of tenant team-a: what its calls name is ignored.
TEAM_A_KEY = "team-a-key-0123456789abcdef"
KEYS = f"{FRONT_KEY} *\n{TEAM_A_KEY} team-a\n"
MODEL = "sim"
PROMPT = "Hello there, how are you today?"
MESSAGES = [{"role": "user", "content": PROMPT}]
TENANT_HEADER = "x-splitserve-tenant"
# Far below the simulated executor's 20 ms step: no forecast can meet it.
IMPOSSIBLE_MS = 1
# Far above anything a request of a few tokens takes.
GENEROUS_MS = 600_000
IGNORE_EOS = {"ignore_eos": True}


@dataclass(slots=True, frozen=True)
class Served:
    stack: TenantStack
    gateway: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("gateway-tenants")
    keys = folder / "api-keys"
    keys.write_text(KEYS)
    with start_tenant_stack(folder, TENANTS, api_key_file=keys) as stack:
        with Client(stack.scheduler, api_key=FRONT_KEY, timeout=60) as client:
            # Steps enough for the scheduler's step-cost model to forecast (it judges no deadline
            # before).
            client.generate(PROMPT, max_tokens=16, ignore_eos=True)
        with start_gateway(stack.scheduler, served_model_name=MODEL) as gateway:
            yield Served(stack, gateway)


def oai_client(served: Served, key: str = FRONT_KEY) -> openai.OpenAI:
    # No retries: a test that expects a 429 must see the first answer.
    return openai.OpenAI(base_url=f"http://{served.gateway}/v1", api_key=key, max_retries=0, timeout=60.0)


@pytest.fixture(scope="module")
def oai(served: Served) -> Iterator[openai.OpenAI]:
    with oai_client(served) as client:
        yield client


def as_tenant(name: str) -> dict[str, str]:
    return {TENANT_HEADER: name}


def generated_tokens(served: Served, tenant: str) -> float:
    samples, _ = scrape(served.stack.metrics_port)
    return samples.get(f'splitserve:tenant_generation_tokens_total{{tenant="{tenant}"}}', 0.0)


def slo_count(served: Served, tenant: str, slo: str) -> float:
    samples, _ = scrape(served.stack.metrics_port)
    return samples.get(f'splitserve:tenant_slo_total{{outcome="met",slo="{slo}",tenant="{tenant}"}}', 0.0)


def retry_after(error: openai.APIStatusError) -> int:
    return int(error.response.headers["retry-after"])


def post(served: Served, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """A raw request, for headers the openai package would not send."""
    connection = http.client.HTTPConnection(served.gateway, timeout=60)
    try:
        connection.request(
            "POST", path, body=json.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {FRONT_KEY}", **headers},
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_the_deadline_fields_reach_the_generate_request() -> None:
    body = ChatCompletionRequest(messages=MESSAGES, ttft_deadline_ms=300, tpot_target_ms=25)
    call = chat_call(body, "chatcmpl-1")
    request = build_generate_request(messages=call.messages, **call.options)
    assert (request.ttft_deadline_ms, request.tpot_target_ms) == (300, 25)


def test_the_tenant_header_names_the_tenant(served: Served, oai: openai.OpenAI) -> None:
    oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, extra_body=IGNORE_EOS, extra_headers=as_tenant("team-blue")
    )
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=IGNORE_EOS, extra_headers=as_tenant("team-blue")
    )
    oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=IGNORE_EOS)
    assert generated_tokens(served, "team-blue") == 3 + 2


def test_a_keys_own_tenant_is_not_overridden_by_the_header(served: Served) -> None:
    with oai_client(served, TEAM_A_KEY) as team_a:
        team_a.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, extra_body=IGNORE_EOS, extra_headers=as_tenant("intruder")
        )
    assert generated_tokens(served, "team-a") == 3
    assert generated_tokens(served, "intruder") == 0


def test_a_tenant_header_that_cannot_be_a_tenant_is_refused(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    status, answer = post(served, "/v1/completions", body, as_tenant("two words"))
    assert status == 400 and answer["error"]["code"] == "invalid_tenant"
    assert answer["error"]["param"] == TENANT_HEADER
    # Metadata can carry it; the scheduler says why it names no tenant.
    status, answer = post(served, "/v1/completions", body, as_tenant("-leading-dash"))
    assert status == 400 and "tenant name" in answer["error"]["message"]


def test_an_impossible_ttft_deadline_is_a_429_with_retry_after(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.RateLimitError) as whole:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ttft_deadline_ms": IMPOSSIBLE_MS})
    # A streamed request is refused before its stream starts, with the same status and header.
    with pytest.raises(openai.RateLimitError) as streamed:
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, stream=True, extra_body={"ttft_deadline_ms": IMPOSSIBLE_MS}
        )
    for refused in (whole.value, streamed.value):
        assert "ttft_deadline_ms" in refused.message
        assert retry_after(refused) >= 1


def test_an_impossible_per_token_target_is_a_429_with_retry_after(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.RateLimitError) as refused:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"tpot_target_ms": IMPOSSIBLE_MS})
    assert "per output token" in refused.value.message
    assert retry_after(refused.value) >= 1


def test_deadlines_that_are_met_are_counted_for_the_tenant(served: Served, oai: openai.OpenAI) -> None:
    targets = {"ttft_deadline_ms": GENEROUS_MS, "tpot_target_ms": GENEROUS_MS, **IGNORE_EOS}
    oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=targets, extra_headers=as_tenant("slo-team")
    )
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=targets, extra_headers=as_tenant("slo-team")
    )
    assert slo_count(served, "slo-team", "ttft") == 2
    assert slo_count(served, "slo-team", "tpot") == 2


def test_a_negative_deadline_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ttft_deadline_ms": -5})
    assert "ttft_deadline_ms" in refused.value.message


def test_a_tenant_over_its_quota_is_a_429_with_retry_after(served: Served, oai: openai.OpenAI) -> None:
    running = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2000, stream=True, extra_body=IGNORE_EOS, extra_headers=as_tenant("solo")
    )
    try:
        next(iter(running))
        with pytest.raises(openai.RateLimitError) as refused:
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_headers=as_tenant("solo"))
        # Another tenant is not held back by solo's quota.
        other = oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, extra_body=IGNORE_EOS, extra_headers=as_tenant("bystander")
        )
    finally:
        running.close()
    assert "max_running" in refused.value.message
    assert refused.value.code == "rate_limit_exceeded"
    assert retry_after(refused.value) >= 1
    assert other.usage is not None and other.usage.completion_tokens == 3
