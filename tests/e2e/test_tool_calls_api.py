"""Tool calling on the default model (SmolLM2-135M, whose template has no tools: they reach it as
the Hermes-style system message), through real processes and the official `openai` package
against the gateway: tool_choice required and named give a get_weather call whose arguments
follow its schema, with finish reason tool_calls, and a stream reassembles to the same call; a
tool result goes back into the prompt; what cannot be served is a 400 naming the problem."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from clients import Client
from clients.cli import main as cli_main
from tests.helpers.executor_process import start_executor
from tests.helpers.gateway_process import start_gateway
from tests.helpers.scheduler_process import start_scheduler

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
GET_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER_PARAMETERS},
}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 32}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# The conversation after the call was answered.
ROUND_TRIP = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": "21 degrees and sunny"},
]


@pytest.fixture(scope="module")
def service(prepared_model: Path) -> Iterator[tuple[str, str]]:
    """(the scheduler's address, the gateway's)."""
    with (
        start_executor(prepared_model, num_kv_blocks=512) as (executor, _),
        start_scheduler(executor, tokenizer=prepared_model) as scheduler,
        start_gateway(scheduler) as gateway,
    ):
        yield scheduler, gateway


@pytest.fixture(scope="module")
def oai(service: tuple[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{service[1]}/v1", api_key="none", max_retries=0, timeout=120.0) as client:
        yield client


def ask(oai: openai.OpenAI, **fields: Any) -> Any:
    model = oai.models.list().data[0].id
    return oai.chat.completions.create(model=model, messages=ASK, max_tokens=96, **{"tools": [GET_WEATHER, GET_TIME], **fields})


def streamed_calls(oai: openai.OpenAI, **fields: Any) -> tuple[list[tuple[str, str]], str | None, str]:
    """(the calls' (name, arguments) as the deltas reassemble, the finish reason, the content)."""
    calls: dict[int, list[str]] = {}
    reason, content = None, ""
    for chunk in ask(oai, stream=True, **fields):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or ():
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
        reason = choice.finish_reason or reason
    return [(name, arguments) for name, arguments in (calls[index] for index in sorted(calls))], reason, content


def weather_calls(message: Any) -> list[dict[str, Any]]:
    """The arguments of each call, every one a get_weather call that follows its schema."""
    assert message.tool_calls, message
    arguments = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather", call
        parsed = json.loads(call.function.arguments)
        jsonschema.validate(parsed, WEATHER_PARAMETERS)
        arguments.append(parsed)
    return arguments


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_named_choice_gives_a_get_weather_call_that_follows_the_schema(oai: openai.OpenAI, temperature: float) -> None:
    for seed in (1, 2) if temperature else (None,):
        answer = ask(oai, tool_choice=NAMED, temperature=temperature, seed=seed)
        (choice,) = answer.choices
        assert len(weather_calls(choice.message)) == 1
        assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_required_gives_a_get_weather_call_that_follows_the_schema(oai: openai.OpenAI) -> None:
    """With get_weather the only tool the call must name it; parallel_tool_calls false: one call."""
    for parallel in (None, False):
        answer = ask(oai, tools=[GET_WEATHER], tool_choice="required", parallel_tool_calls=parallel, temperature=0.0)
        (choice,) = answer.choices
        calls = weather_calls(choice.message)
        assert choice.finish_reason == "tool_calls" and (parallel is None or len(calls) == 1)


def test_required_among_two_tools_calls_one_of_them_with_its_schema(oai: openai.OpenAI) -> None:
    for seed in (1, 2, 3):
        (choice,) = ask(oai, tool_choice="required", temperature=0.8, seed=seed).choices
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            schema = {"get_weather": GET_WEATHER, "get_time": GET_TIME}[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_required_follows_a_schema_whose_nested_model_is_a_reference(oai: openai.OpenAI) -> None:
    """Parameters as pydantic writes a nested model ($defs and $ref) constrain a required call."""
    parameters = {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["place", "unit"],
        "$defs": {
            "Place": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
                "additionalProperties": False,
            }
        },
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    (choice,) = ask(oai, tools=[tool], tool_choice="required", temperature=0.0).choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), parameters)


@pytest.mark.parametrize(("tool_choice", "tools"), [(NAMED, [GET_WEATHER, GET_TIME]), ("required", [GET_WEATHER])])
def test_a_streamed_call_reassembles_to_the_whole_answers(oai: openai.OpenAI, tool_choice: Any, tools: list[Any]) -> None:
    (whole,) = ask(oai, tools=tools, tool_choice=tool_choice, temperature=0.0).choices
    calls, reason, content = streamed_calls(oai, tools=tools, tool_choice=tool_choice, temperature=0.0)
    assert calls == [(call.function.name, call.function.arguments) for call in whole.message.tool_calls]
    assert reason == whole.finish_reason == "tool_calls" and content == ""
    weather_calls(whole.message)


def test_a_tool_result_goes_back_into_the_prompt(oai: openai.OpenAI, service: tuple[str, str]) -> None:
    """The gateway's /tokenize renders as a chat completion does; the prompt holds the tools, the
    call and its result, in the Hermes form the default model's template lacks."""
    tokens = _post(service[1], "/tokenize", {"messages": ROUND_TRIP, "tools": [GET_WEATHER]})["tokens"]
    prompt = _post(service[1], "/detokenize", {"tokens": tokens})["prompt"]
    assert f"<tools>\n{json.dumps(GET_WEATHER)}\n</tools>" in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\n21 degrees and sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in prompt
    # The Python client renders the same chat to the same tokens.
    with Client(service[0]) as client:
        assert client.tokenize(messages=ROUND_TRIP, tools=[GET_WEATHER]).token_ids == tokens
    # And the model answers it (auto: text, or another call).
    (choice,) = oai.chat.completions.create(
        model=oai.models.list().data[0].id, messages=ROUND_TRIP, tools=[GET_WEATHER], max_tokens=24, temperature=0.0
    ).choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_the_cli_sends_tools_with_a_chat(service: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """The answer is the model's text; a grammar can make it the call's arguments."""
    tools = ["--tools", json.dumps([GET_WEATHER]), "--json-schema", json.dumps(WEATHER_PARAMETERS)]
    command = ["generate", "--server", service[0], "What is the weather in Paris?", "--temperature", "0", *tools]
    assert cli_main([*command, "--chat"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), WEATHER_PARAMETERS)
    assert cli_main(command) == 2 and "tools needs messages" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_forecast"}}},
         "tool_choice names function 'get_forecast', which is not among the tools (get_time, get_weather)"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]: only function tools are supported (type 'function')"),
        (
            {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "strnig"}}}}}]},
            'chat.tools[0].parameters is not a JSON schema: properties.city.type: "strnig" is not a JSON Schema type',
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "(unclosed"}}}}}],
             "tool_choice": "required"},
            "structured_output json_schema cannot be compiled",
        ),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_problem(oai: openai.OpenAI, fields: dict[str, Any], problem: str) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            ask(oai, stream=stream, **fields)
        assert error.value.status_code == 400 and problem in error.value.body["message"], error.value.body


def _post(gateway: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{gateway}{path}", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)
