"""The OpenAI-compatible gateway driven by the official `openai` package, against real processes:
a random-weight Llama executor, a scheduler with Qwen3's tokenizer (chat template included), an
API key file and TLS, and the gateway in front of it (trusting the scheduler's CA). Answers are checked against the gRPC client
API's for the same request; aborts are checked through the scheduler's GetServerStatus."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import trustme

from clients import Client, SplitserveError
from clients.openai_gateway.errors import GatewayError, from_splitserve
from clients.openai_gateway.schemas import ChatCompletionRequest, CompletionRequest
from clients.openai_gateway.translate import chat_call, completion_call
from clients.request_builder import build_generate_request
from protos.splitserve.v1 import generation_pb2 as pb
from tests.helpers.executor_process import start_executor
from tests.helpers.gateway_process import GatewayProcess, start_gateway
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import SchedulerProcess
from tests.helpers.service_process import free_port
from tests.helpers.tokenizer_assets import qwen3_tokenizer_dir

API_KEY = "gateway-test-key-0123456789"
MODEL_NAME = "tiny-llama"
# Qwen3's tokenizer: the random model's vocabulary must hold every id it makes.
VOCAB_SIZE = 151_936
# Long enough that a request without max_tokens would run for a long while: what the abort
# tests cut short.
MAX_MODEL_LEN = 8192
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]
IGNORE_EOS = {"ignore_eos": True}


@dataclass(slots=True, frozen=True)
class Stack:
    scheduler: str
    # The CA of the scheduler's TLS certificate.
    ca: Path
    scheduler_process: SchedulerProcess
    gateway: str
    gateway_process: GatewayProcess


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("gateway")
    model_dir = build_model(
        "llama", folder / "llama", seed=9, vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_MODEL_LEN
    )
    keys = folder / "api-keys"
    keys.write_text(f"{API_KEY}\n")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    certificate = ca.issue_cert("127.0.0.1", "localhost")
    certificate.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    certificate.private_key_pem.write_to_path(str(folder / "server-key.pem"))
    with start_executor(model_dir, num_kv_blocks=1024) as (executor, _):
        scheduler = SchedulerProcess(
            executor,
            tokenizer=qwen3_tokenizer_dir(),
            api_key_file=keys,
            tls_cert=folder / "server.pem",
            tls_key=folder / "server-key.pem",
        )
        try:
            address = scheduler.wait_ready(timeout_s=120.0)
            gateway = GatewayProcess(address, served_model_name=MODEL_NAME, tls_ca=folder / "ca.pem")
            try:
                ready = gateway.wait_ready(timeout_s=60.0)
                yield Stack(address, folder / "ca.pem", scheduler, ready, gateway)
            finally:
                gateway.close()
        finally:
            scheduler.close()


@pytest.fixture(scope="module")
def oai(stack: Stack) -> Iterator[openai.OpenAI]:
    # No retries: a test that expects an error must see the first answer.
    with openai.OpenAI(
        base_url=f"http://{stack.gateway}/v1", api_key=API_KEY, max_retries=0, timeout=60.0
    ) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(stack: Stack) -> Iterator[Client]:
    with Client(
        stack.scheduler, api_key=API_KEY, root_certificates=stack.ca.read_bytes(), timeout=60.0
    ) as client:
        yield client


def http_request(
    address: str, method: str, path: str, body: dict[str, Any] | None = None, token: str | None = API_KEY
) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection(address, timeout=60)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def wait_until_idle(client: Client, timeout_s: float = 10.0) -> pb.ServerStatus:
    """The scheduler's status once nothing runs and every KV block is free (or at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.server_status()
        idle = status.num_running == 0 and status.num_waiting == 0
        if (idle and status.kv_blocks_free == status.kv_blocks_total) or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


# --- translation (no processes) ---------------------------------------------------------------


def test_fields_the_caller_left_out_stay_unset_for_the_models_defaults() -> None:
    for call in (
        chat_call(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), "chatcmpl-1"),
        completion_call(CompletionRequest(prompt="hi"), "cmpl-1"),
    ):
        request = build_generate_request(
            call.prompt, prompt_token_ids=call.prompt_token_ids, messages=call.messages, **call.options
        )
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "logprobs"):
            assert not request.sampling.HasField(name), name


def test_chat_fields_map_as_openai_and_vllm_define_them() -> None:
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_tokens=50,
        max_completion_tokens=6,
        top_k=-1,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    call = chat_call(body, "chatcmpl-1")
    assert call.messages == [{"role": "user", "content": "a\nb"}]
    assert call.options["max_tokens"] == 6 and call.options["top_k"] == 0
    assert call.options["logprobs"] == 3 and call.options["temperature"] == 0


def test_response_format_and_structured_outputs_become_the_requests_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    messages = [{"role": "user", "content": "hi"}]

    def grammar(**fields: Any) -> pb.StructuredOutput:
        call = chat_call(ChatCompletionRequest(messages=messages, **fields), "chatcmpl-1")
        return build_generate_request(messages=call.messages, **call.options).sampling.structured_output

    as_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert json.loads(grammar(response_format=as_schema).json_schema) == schema
    assert grammar(response_format={"type": "json_object"}).json_object
    assert grammar(response_format={"type": "text"}) == pb.StructuredOutput()
    assert list(grammar(structured_outputs={"choice": ["x", "y"]}).choice.choices) == ["x", "y"]
    call = completion_call(CompletionRequest(prompt="hi", structured_outputs={"regex": "[ab]+"}), "cmpl-1")
    assert call.options["structured_output"] == {"regex": "[ab]+"}
    for fields, problem in (
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"structured_outputs": {"xml": "a"}}, "exactly one of"),
        ({"structured_outputs": {"choice": "ab"}}, "a list of strings"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "needs json_schema.schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ):
        with pytest.raises(GatewayError) as error:
            chat_call(ChatCompletionRequest(messages=messages, **fields), "chatcmpl-1")
        assert error.value.status == 400 and problem in error.value.body()["error"]["message"], fields


@pytest.mark.parametrize(
    ("code", "status", "error_type"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.ALREADY_EXISTS, 409, "conflict_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
        (grpc.StatusCode.UNKNOWN, 500, "server_error"),
    ],
)
def test_grpc_statuses_become_http_statuses(code: grpc.StatusCode, status: int, error_type: str) -> None:
    error = from_splitserve(SplitserveError(code, "the scheduler's reason"))
    assert error.status == status
    assert error.body()["error"]["message"] == "the scheduler's reason"
    assert error.body()["error"]["type"] == error_type
    # Overload carries OpenAI's own code, which its clients know; the rest the status's name.
    expected_code = "rate_limit_exceeded" if status == 429 else code.name.lower()
    assert error.body()["error"]["code"] == expected_code


def test_a_request_too_large_for_the_scheduler_to_read_is_413_not_a_retried_429() -> None:
    details = "SERVER: Received message larger than max (4194330 vs. 2788864)"
    error = from_splitserve(SplitserveError(grpc.StatusCode.RESOURCE_EXHAUSTED, details))
    assert (error.status, error.body()["error"]["code"]) == (413, "request_too_large")
    assert details in error.message and "--max-prompt-bytes" in error.message
    assert not error.headers


def test_openais_harmless_fields_are_taken_and_developer_is_system() -> None:
    body = ChatCompletionRequest(
        messages=[{"role": "developer", "content": "Be brief.", "name": "ops"}, {"role": "user", "content": "hi"}],
        store=False, metadata={"team": "a"}, user="u-1", reasoning_effort="low", service_tier="auto",
        parallel_tool_calls=True,
    )
    call = chat_call(body, "chatcmpl-1")
    assert call.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


# --- completions ------------------------------------------------------------------------------


def test_completion_answers_as_the_grpc_api_does(oai: openai.OpenAI, grpc_client: Client) -> None:
    expected = grpc_client.generate(prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    completion = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=IGNORE_EOS
    )
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == MODEL_NAME and completion.created > 0
    choice = completion.choices[0]
    assert (choice.index, choice.text, choice.finish_reason) == (0, expected.text, "length")
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.usage.prompt_tokens, 8)
    assert usage.total_tokens == usage.prompt_tokens + 8
    # The same prompt just ran: its full blocks come from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens >= 16

    token_ids = [5, 17, 40, 99, 1234]
    by_ids = grpc_client.generate(prompt_token_ids=token_ids, max_tokens=4, temperature=0, ignore_eos=True)
    completion = oai.completions.create(
        model=MODEL_NAME, prompt=token_ids, max_tokens=4, temperature=0, extra_body=IGNORE_EOS
    )
    assert completion.choices[0].text == by_ids.text and completion.usage.prompt_tokens == 5


def test_logit_bias_and_allowed_token_ids_shape_the_answer(oai: openai.OpenAI, grpc_client: Client) -> None:
    favoured, other = 1234, 99
    plain = grpc_client.generate(prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    expected = grpc_client.generate(
        prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logit_bias={favoured: 100.0}
    )
    assert expected.token_ids == [favoured] * 6 != plain.token_ids
    biased = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(favoured): 100},
        extra_body=IGNORE_EOS,
    )
    assert biased.choices[0].text == expected.text != plain.text

    allowed = [favoured, other]
    expected = grpc_client.generate(
        prompt=PROMPT, max_tokens=6, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=allowed
    )
    assert set(expected.token_ids) <= set(allowed)
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=4,
        extra_body={**IGNORE_EOS, "allowed_token_ids": allowed},
    )
    restricted = grpc_client.generate(
        messages=MESSAGES, max_tokens=6, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=allowed
    )
    assert chat.choices[0].message.content == restricted.text
    assert set(restricted.token_ids) <= set(allowed)


def test_completion_stream_ends_with_a_usage_chunk(oai: openai.OpenAI, grpc_client: Client) -> None:
    expected = grpc_client.generate(prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    arguments: dict[str, Any] = dict(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body=IGNORE_EOS
    )
    chunks = list(oai.completions.create(**arguments, stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])
    assert all(chunk.usage is None for chunk in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.total_tokens == expected.usage.prompt_tokens + 8
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert {chunk.object for chunk in chunks} == {"text_completion"}

    without_usage = list(oai.completions.create(**arguments))
    assert all(chunk.choices and chunk.usage is None for chunk in without_usage)


def test_n_choices_and_best_of_answer_as_the_grpc_api_does(oai: openai.OpenAI, grpc_client: Client) -> None:
    expected = grpc_client.generate(prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, n=3)
    texts = [choice.text for choice in expected.choices]
    arguments: dict[str, Any] = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3, n=3, extra_body=IGNORE_EOS)
    completion = oai.completions.create(**arguments)
    assert [(c.index, c.text, c.finish_reason) for c in completion.choices] == [(i, t, "length") for i, t in enumerate(texts)]
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (expected.usage.prompt_tokens, 15)
    chunks = list(oai.completions.create(**arguments, stream=True, stream_options={"include_usage": True}))
    streamed: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == dict(enumerate(texts)) and chunks[-1].usage.completion_tokens == 15

    best = grpc_client.generate(prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, n=2, best_of=3)
    ranked = oai.completions.create(**{**arguments, "n": 2}, best_of=3)
    assert [c.text for c in ranked.choices] == [c.text for c in best.choices]

    chat_expected = grpc_client.generate(messages=MESSAGES, max_tokens=4, temperature=1.0, seed=8, ignore_eos=True, n=2)
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=1.0, seed=8, n=2, extra_body=IGNORE_EOS
    )
    assert [c.message.content for c in chat.choices] == [c.text for c in chat_expected.choices]
    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=1.0, seed=8, n=2, stream=True, extra_body=IGNORE_EOS
        )
    )
    roles = [choice.index for chunk in chunks for choice in chunk.choices if choice.delta.role == "assistant"]
    contents: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            contents[choice.index] = contents.get(choice.index, "") + (choice.delta.content or "")
    assert roles == [0, 1] and contents == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}


# --- chat -------------------------------------------------------------------------------------


def test_chat_answers_as_the_grpc_api_does(oai: openai.OpenAI, grpc_client: Client) -> None:
    expected = grpc_client.generate(messages=MESSAGES, max_tokens=6, temperature=0, ignore_eos=True)
    # max_completion_tokens wins over max_tokens.
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=50, max_completion_tokens=6, temperature=0,
        extra_body=IGNORE_EOS,
    )
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion" and chat.model == MODEL_NAME
    choice = chat.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", expected.text)
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (expected.usage.prompt_tokens, 6)

    as_parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=as_parts, max_completion_tokens=6, temperature=0, extra_body=IGNORE_EOS
    )
    assert chat.choices[0].message.content == expected.text


def test_chat_stream_names_the_role_then_streams_the_answer(oai: openai.OpenAI, grpc_client: Client) -> None:
    expected = grpc_client.generate(messages=MESSAGES, max_tokens=6, temperature=0, ignore_eos=True)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
        )
    )
    *answer, usage_chunk = chunks
    assert answer[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in answer) == expected.text
    assert answer[-1].choices[0].finish_reason == "length"
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6


def test_concurrent_streams_share_the_gateways_channel(stack: Stack) -> None:
    async def one(client: openai.AsyncOpenAI, seed: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8, seed=seed, stream=True,
            stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        return text, chunks[-1].usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(
            base_url=f"http://{stack.gateway}/v1", api_key=API_KEY, max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, seed) for seed in range(8)))

    answers = asyncio.run(run())
    assert [tokens for _, tokens in answers] == [8] * 8
    assert len({text for text, _ in answers}) > 1  # eight seeds, not one answer copied


# --- sampling ---------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_answer(oai: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        completion = oai.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, extra_body=IGNORE_EOS
        )
        return completion.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_strings_end_the_answer_before_them(oai: openai.OpenAI, grpc_client: Client) -> None:
    full = grpc_client.generate(prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    arguments: dict[str, Any] = dict(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=IGNORE_EOS
    )
    completion = oai.completions.create(**arguments, stop=stop)
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (expected, "stop")
    chunks = list(oai.completions.create(**arguments, stop=[stop, "never-in-the-answer"], stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def openai_token(raw: bytes | None) -> str:
    """How OpenAI names a token: its text, or its escaped bytes when they are part of a character."""
    assert raw is not None, "the scheduler has a tokenizer, so every token comes with its bytes"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def test_completion_logprobs_name_tokens_by_their_text(oai: openai.OpenAI, grpc_client: Client) -> None:
    expected = grpc_client.generate(prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    completion = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, extra_body=IGNORE_EOS
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [openai_token(record.token_bytes) for record in expected.logprobs]
    assert logprobs.token_logprobs == pytest.approx([record.logprob for record in expected.logprobs])
    for top, record in zip(logprobs.top_logprobs, expected.logprobs, strict=True):
        assert top == pytest.approx(
            {openai_token(raw): lp for raw, lp in zip(record.top_token_bytes, record.top_logprobs, strict=True)}
        )
        # Greedy: the sampled token is the most likely one.
        assert record.token_id == record.top_token_ids[0]
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(completion.choices[0].text)


def test_chat_logprobs_in_openai_format(oai: openai.OpenAI, grpc_client: Client) -> None:
    expected = grpc_client.generate(messages=MESSAGES, max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    arguments: dict[str, Any] = dict(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3, extra_body=IGNORE_EOS,
    )
    content = oai.chat.completions.create(**arguments).choices[0].logprobs.content
    assert [entry.token for entry in content] == [openai_token(r.token_bytes) for r in expected.logprobs]
    assert [entry.bytes for entry in content] == [list(r.token_bytes or b"") for r in expected.logprobs]
    assert [entry.logprob for entry in content] == pytest.approx([r.logprob for r in expected.logprobs])
    for entry, record in zip(content, expected.logprobs, strict=True):
        assert [top.token for top in entry.top_logprobs] == [openai_token(raw) for raw in record.top_token_bytes]
        assert [top.bytes for top in entry.top_logprobs] == [list(raw) for raw in record.top_token_bytes]
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(record.top_logprobs)
    streamed = [
        entry
        for chunk in oai.chat.completions.create(**arguments, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [entry.token for entry in streamed] == [entry.token for entry in content]


def test_include_stop_str_in_output_keeps_the_stop_string(oai: openai.OpenAI, grpc_client: Client) -> None:
    full = grpc_client.generate(prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop) + len(stop)]
    by_grpc = grpc_client.generate(
        prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert (by_grpc.text, by_grpc.finish_reason, by_grpc.stop_reason) == (expected, "stop", stop)
    arguments: dict[str, Any] = dict(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
        extra_body={**IGNORE_EOS, "include_stop_str_in_output": True},
    )
    completion = oai.completions.create(**arguments)
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (expected, "stop")
    chunks = list(oai.completions.create(**arguments, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected


def test_openais_harmless_fields_and_the_developer_role_answer_as_system(
    oai: openai.OpenAI, grpc_client: Client
) -> None:
    expected = grpc_client.generate(messages=MESSAGES, max_tokens=6, temperature=0, ignore_eos=True)
    developer = [{**MESSAGES[0], "role": "developer", "name": "ops"}, {**MESSAGES[1], "name": "alice"}]
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=developer, max_completion_tokens=6, temperature=0, store=False,
        metadata={"team": "a"}, user="user-1", reasoning_effort="low", service_tier="auto",
        parallel_tool_calls=True, extra_body=IGNORE_EOS,
    )
    assert chat.choices[0].message.content == expected.text
    assert chat.usage.prompt_tokens == expected.usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(stack: Stack, oai: openai.OpenAI, grpc_client: Client) -> None:
    no_thinking = {"enable_thinking": False}
    plain = grpc_client.tokenize(messages=MESSAGES).token_ids
    expected = grpc_client.tokenize(messages=MESSAGES, chat_template_kwargs=no_thinking).token_ids
    # Qwen3's template opens an empty thinking block when thinking is off.
    assert expected[: len(plain)] == plain and len(expected) > len(plain)
    status, body = http_request(
        stack.gateway, "POST", "/tokenize", {"model": MODEL_NAME, "messages": MESSAGES, "chat_template_kwargs": no_thinking}
    )
    assert (status, body["tokens"], body["count"]) == (200, expected, len(expected))
    chat = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2, temperature=0,
        extra_body={"chat_template_kwargs": no_thinking},
    )
    assert chat.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
        ({"messages": "[]"}, "may not set 'messages'"),
        ({"nested": {"a": 1}}, "chat_template_kwargs.nested must be a boolean, a number or a string"),
        ({f"v{i}": True for i in range(33)}, "at most 32"),
    ],
)
def test_chat_template_kwargs_the_server_will_not_pass_get_400(
    oai: openai.OpenAI, variables: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2, extra_body={"chat_template_kwargs": variables}
        )
    assert message in error.value.body["message"]


def test_max_tokens_beyond_the_context_is_refused_as_vllm_does(oai: openai.OpenAI, grpc_client: Client) -> None:
    prompt_tokens = len(grpc_client.tokenize(PROMPT).token_ids)
    expected = (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{prompt_tokens + MAX_MODEL_LEN} tokens ({prompt_tokens} in the messages, {MAX_MODEL_LEN} in the "
        "completion). Please reduce the length of the messages or completion."
    )
    with pytest.raises(SplitserveError) as refused:
        grpc_client.generate(prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT and refused.value.details == expected
    with pytest.raises(openai.BadRequestError) as error:
        oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    assert error.value.body["message"] == expected
    chat_tokens = len(grpc_client.tokenize(messages=MESSAGES).token_ids)
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=MAX_MODEL_LEN - 1)
    assert f"({chat_tokens} in the messages, {MAX_MODEL_LEN - 1} in the completion)" in error.value.body["message"]


# --- tokenize, detokenize, version -------------------------------------------------------------


def test_tokenize_and_detokenize_as_vllm_serves_them(stack: Stack, grpc_client: Client) -> None:
    expected = grpc_client.tokenize(PROMPT)
    status, body = http_request(stack.gateway, "POST", "/tokenize", {"model": MODEL_NAME, "prompt": PROMPT})
    assert status == 200
    assert body == {"count": len(expected.token_ids), "max_model_len": MAX_MODEL_LEN, "tokens": expected.token_ids, "token_strs": None}
    status, body = http_request(stack.gateway, "POST", "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert (status, body["token_strs"]) == (200, expected.tokens)

    chat = grpc_client.tokenize(messages=MESSAGES, add_generation_prompt=False).token_ids
    status, body = http_request(
        stack.gateway, "POST", "/tokenize", {"model": MODEL_NAME, "messages": MESSAGES, "add_generation_prompt": False}
    )
    assert (status, body["tokens"]) == (200, chat)

    status, body = http_request(stack.gateway, "POST", "/detokenize", {"model": MODEL_NAME, "tokens": expected.token_ids})
    assert (status, body) == (200, {"prompt": PROMPT})
    # Special tokens are written, as vLLM's /detokenize does.
    assert grpc_client.detokenize(chat).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert http_request(stack.gateway, "POST", "/detokenize", {"tokens": chat})[1]["prompt"] == grpc_client.detokenize(chat)


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/tokenize", {"prompt": PROMPT, "messages": MESSAGES}, 400, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, 400, "may not set 'tokenize'"),
        ("/tokenize", {"model": "gpt-4o", "prompt": PROMPT}, 404, "does not exist"),
        ("/detokenize", {"tokens": [5, VOCAB_SIZE + 1]}, 400, "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "token_ids"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_tokenize_and_detokenize_requests_say_why(
    stack: Stack, path: str, body: dict[str, Any], status: int, message: str
) -> None:
    answer_status, answer = http_request(stack.gateway, "POST", path, body)
    assert answer_status == status and message in answer["error"]["message"], answer


def test_version_is_the_installed_packages(stack: Stack) -> None:
    assert http_request(stack.gateway, "GET", "/version", token=None) == (200, {"version": metadata.version("splitserve")})


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"temperature": -1}, "temperature"),  # the scheduler's own message
        ({"n": 2, "echo": True}, "echo is supported with one choice only"),
        ({"n": 0}, "n must be at least 1"),
        ({"n": 3, "best_of": 2}, "best_of must be at least n (3)"),
        ({"max_tokens": 0}, "0 only with prompt_logprobs"),  # echo with logprobs scores the prompt alone
        ({"prompt": ["one", "two"]}, "several prompts"),
        ({"extra_body": {"best_guess": 1}}, "best_guess: unsupported field"),
        ({"extra_body": {"max_tokens": "many"}}, "max_tokens"),
        ({"logit_bias": {str(VOCAB_SIZE): 1.0}}, "logit_bias names token"),
        ({"logit_bias": {"5": 101}}, "logit_bias values"),
        ({"logit_bias": {"five": 1}}, "logit_bias keys must be token ids"),
    ],
)
def test_bad_completion_requests_get_400(oai: openai.OpenAI, arguments: dict[str, Any], message: str) -> None:
    request: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, **arguments}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            oai.completions.create(**request, stream=stream)
        assert error.value.status_code == 400 and message in error.value.body["message"]
        assert error.value.body["type"] == "invalid_request_error"


def test_a_prompt_too_large_for_the_scheduler_is_413_and_one_over_its_cap_400(oai: openai.OpenAI) -> None:
    """Past the scheduler's gRPC ceiling (twice what its caps allow, 2.7 MiB) the message is
    refused unread, which OpenAI's clients must not take for overload and retry; over the caps
    but under it, the scheduler names the cap."""
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as error:
            oai.completions.create(model=MODEL_NAME, prompt="x" * (4 << 20), max_tokens=2, stream=stream)
        assert error.value.status_code == 413 and error.value.body["code"] == "request_too_large"
        assert "larger than the scheduler reads" in error.value.body["message"]
        with pytest.raises(openai.BadRequestError) as error:
            oai.completions.create(model=MODEL_NAME, prompt="x" * (2 << 20), max_tokens=2, stream=stream)
        assert "--max-prompt-bytes" in error.value.body["message"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions is not supported; use tools"),
        ({"response_format": {"type": "yaml"}}, "response_format 'yaml' is not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
        ({"top_logprobs": 2}, "logprobs"),
    ],
)
def test_unsupported_chat_features_get_400(oai: openai.OpenAI, arguments: dict[str, Any], message: str) -> None:
    request: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **arguments}
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(**request)
    assert message in error.value.body["message"]


def test_an_unknown_model_is_not_found(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        oai.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert error.value.status_code == 404 and error.value.code == "model_not_found"


def test_the_callers_key_is_what_the_scheduler_checks(stack: Stack) -> None:
    with openai.OpenAI(base_url=f"http://{stack.gateway}/v1", api_key="wrong-key-0123456789abc", max_retries=0) as wrong:
        for call in (
            lambda: wrong.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2),
            lambda: wrong.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, stream=True),
            wrong.models.list,
            # A wrong key learns nothing about which model names exist.
            lambda: wrong.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2),
        ):
            with pytest.raises(openai.AuthenticationError) as error:
                call()
            assert error.value.status_code == 401 and "not valid" in error.value.body["message"]
    status, body = http_request(
        stack.gateway, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi"}, token=None
    )
    assert status == 401 and "needs an API key" in body["error"]["message"]


def test_an_error_after_the_stream_started_arrives_as_an_error_event(
    oai: openai.OpenAI, grpc_client: Client
) -> None:
    stream = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stream=True, temperature=0, extra_body=IGNORE_EOS
    )
    first = next(stream)
    # An operator's Abort (or a scheduler shutting down) ends the stream without an OpenAI
    # finish reason: the client sees an error event instead of a clean end.
    assert grpc_client.abort(first.id)
    with pytest.raises(openai.APIError) as error:
        for _ in stream:
            pass
    assert error.value.code == "aborted" and "aborted" in error.value.message
    assert wait_until_idle(grpc_client).num_running == 0


# --- models and health ------------------------------------------------------------------------


def test_models_and_health(stack: Stack, oai: openai.OpenAI, grpc_client: Client) -> None:
    models = oai.models.list().data
    assert [model.id for model in models] == [MODEL_NAME]
    assert models[0].object == "model" and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert oai.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert http_request(stack.gateway, "GET", "/health", token=None) == (200, {"status": "serving"})

    # Without --served-model-name the model goes by the executor's model_id.
    model_id = grpc_client.model_info().model_id
    with start_gateway(stack.scheduler, tls_ca=stack.ca) as address:
        with openai.OpenAI(base_url=f"http://{address}/v1", api_key=API_KEY, max_retries=0) as plain:
            assert [model.id for model in plain.models.list().data] == [model_id]
            completion = plain.completions.create(model=model_id, prompt=PROMPT, max_tokens=2)
            assert completion.model == model_id and completion.usage.completion_tokens <= 2


def test_without_a_scheduler_health_and_requests_say_unavailable() -> None:
    with start_gateway(f"127.0.0.1:{free_port()}", served_model_name=MODEL_NAME) as address:
        assert http_request(address, "GET", "/health", token=None) == (503, {"status": "not_serving"})
        with openai.OpenAI(base_url=f"http://{address}/v1", api_key=API_KEY, max_retries=0) as orphan:
            with pytest.raises(openai.InternalServerError) as error:
                orphan.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert error.value.status_code == 503 and error.value.code == "unavailable"


# --- clients that go away ---------------------------------------------------------------------


def test_a_stream_whose_client_disconnects_is_aborted(
    stack: Stack, oai: openai.OpenAI, grpc_client: Client
) -> None:
    # No max_tokens and ignore_eos: left alone it would run to the model's 8,192 tokens.
    stream = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, stream=True, temperature=0, extra_body=IGNORE_EOS
    )
    chunks = [next(stream) for _ in range(3)]
    assert grpc_client.server_status().num_running == 1
    stream.close()
    status = wait_until_idle(grpc_client)
    assert status.num_running == 0 and status.kv_blocks_free == status.kv_blocks_total
    assert f"event=request_cancelled request_id={chunks[0].id}" in stack.scheduler_process.log_text()


def test_a_request_whose_client_disconnects_is_aborted(
    stack: Stack, oai: openai.OpenAI, grpc_client: Client
) -> None:
    cancelled_before = stack.scheduler_process.log_text().count("event=request_cancelled")
    with pytest.raises(openai.APITimeoutError):
        # The client gives up after 2 s and closes its connection, long before the answer.
        oai.with_options(timeout=2.0).completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body=IGNORE_EOS)
    status = wait_until_idle(grpc_client)
    assert status.num_running == 0 and status.kv_blocks_free == status.kv_blocks_total
    assert stack.scheduler_process.log_text().count("event=request_cancelled") == cancelled_before + 1
    gateway_log = stack.gateway_process.log_text()
    assert re.search(r"event=client_disconnected request_id=cmpl-\w+ streaming=false", gateway_log)

