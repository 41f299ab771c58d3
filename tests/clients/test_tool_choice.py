"""OpenAI's tools, tool_choice and parallel_tool_calls as the gateway turns them into a Generate
call: which tools are rendered, which grammar forces a call, and 400s that name what is wrong."""

from __future__ import annotations

from typing import Any

import pytest

from clients.openai_gateway.errors import GatewayError
from clients.openai_gateway.schemas import ChatCompletionRequest
from clients.openai_gateway.tool_choice import ToolMode
from clients.openai_gateway.translate import GenerateCall, chat_call
from clients.request_builder import build_generate_request

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def call(**fields: Any) -> GenerateCall:
    return chat_call(ChatCompletionRequest(**{"messages": ASK, **fields}), "chatcmpl-1")


def refused(**fields: Any) -> GatewayError:
    with pytest.raises(GatewayError) as error:
        call(**fields)
    assert error.value.status == 400
    return error.value


def test_auto_is_the_default_and_renders_the_tools_unconstrained() -> None:
    made = call(tools=[WEATHER, TIME])
    assert made.tool_plan is not None and made.tool_plan.mode is ToolMode.AUTO
    assert made.options["tools"] == [WEATHER, TIME] and made.options.get("structured_output") is None
    request = build_generate_request(messages=made.messages, **made.options)
    assert [(tool.name, tool.description) for tool in request.chat.tools] == [("get_weather", "Weather now"), ("get_time", "")]


def test_none_leaves_the_tools_out_of_the_prompt() -> None:
    made = call(tools=[WEATHER], tool_choice="none")
    assert made.tool_plan is not None and made.tool_plan.mode is ToolMode.NONE
    assert "tools" not in made.options


def test_required_constrains_the_answer_to_an_array_of_calls() -> None:
    made = call(tools=[WEATHER, TIME], tool_choice="required")
    calls = [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": PARAMETERS}, "required": ["name", "arguments"]},
        {
            "type": "object",
            "properties": {"name": {"const": "get_time"}, "arguments": {"type": "object", "properties": {}}},
            "required": ["name", "arguments"],
        },
    ]
    assert made.options["structured_output"] == {"json": {"type": "array", "minItems": 1, "items": {"anyOf": calls}}}
    single = call(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert single.options["structured_output"]["json"]["maxItems"] == 1


def test_required_keeps_a_parameters_schemas_references_resolving_against_its_own_root() -> None:
    """As pydantic writes a nested model: "#/$defs/Place" must not resolve against the array of
    calls that the required choice nests the parameters in."""
    parameters = {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}},
        "required": ["place"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    }
    nested = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    schema = call(tools=[nested], tool_choice="required").options["structured_output"]["json"]
    assert schema["items"]["properties"]["arguments"] == {"$ref": "#/$defs/get_weather"}
    moved = schema["$defs"]["get_weather"]
    assert moved["properties"]["place"] == {"$ref": "#/$defs/get_weather/$defs/Place"}
    assert moved["$defs"] == parameters["$defs"]


def test_a_named_function_constrains_the_answer_to_its_arguments() -> None:
    made = call(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert made.tool_plan is not None and made.tool_plan.forced == "get_weather"
    assert made.options["structured_output"] == {"json": PARAMETERS}


def test_calls_and_results_in_the_messages_go_to_the_template() -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    made = call(messages=messages, tools=[WEATHER])
    chat = build_generate_request(messages=made.messages, **made.options).chat
    assert chat.messages[1].content == "" and chat.messages[1].tool_calls[0].arguments == '{"city": "Paris"}'
    assert (chat.messages[2].role, chat.messages[2].tool_call_id, chat.messages[2].content) == ("tool", "call_1", "21 C")


@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice",
         "tool_choice names function 'get_wether', which is not among the tools (get_weather)"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice 'sometimes' is not one of"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]: only function tools are supported (type 'function'), got 'retrieval'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools",
         "tools[0].function.parameters must be a JSON schema (an object)"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "tool_choice required constrains the answer to a call"),
        ({"functions": [{"name": "f"}]}, "functions", "use tools and tool_choice"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(fields: dict[str, Any], param: str, problem: str) -> None:
    error = refused(**fields)
    assert error.param == param and problem in error.message
