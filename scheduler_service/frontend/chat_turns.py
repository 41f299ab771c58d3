"""A request's Chat as the tokenizer renders it: the turns (with their tool calls, results and
names) and the tools, in the shapes transformers' chat templates read, checked on the way. What
is wrong ends the request with INVALID naming the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.frontend.json_schema_shape import schema_problem

# OpenAI's rule for a function's name.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Arrays and objects nested in a tool's parameters or a call's arguments: far past any real schema, well
# short of the recursion the template's rendering could take.
MAX_JSON_DEPTH = 64


@dataclass(slots=True, frozen=True)
class ChatInput:
    # {"role", "content"} and, where set, "tool_calls", "tool_call_id" and "name".
    turns: list[dict[str, Any]]
    # {"type": "function", "function": {"name", "description"?, "parameters"?}}.
    tools: list[dict[str, Any]]


def chat_input(chat: pb.Chat) -> ChatInput:
    tools = [_tool(index, tool) for index, tool in enumerate(chat.tools)]
    names = [tool["function"]["name"] for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        _reject(f"chat.tools name {repeated[0]!r} more than once; a tool's name must be unique")
    return ChatInput([_turn(index, message) for index, message in enumerate(chat.messages)], tools)


def _tool(index: int, tool: pb.Tool) -> dict[str, Any]:
    where = f"chat.tools[{index}]"
    function: dict[str, Any] = {"name": _function_name(tool.name, f"{where}.name")}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        parameters = _json(tool.parameters, f"{where}.parameters")
        problem = schema_problem(parameters)
        if problem is not None:
            _reject(f"{where}.parameters is not a JSON schema: {problem}")
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _turn(index: int, message: pb.ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [
            _call(call, f"chat.messages[{index}].tool_calls[{number}]")
            for number, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.name:
        turn["name"] = message.name
    return turn


def _call(call: pb.ToolCall, where: str) -> dict[str, Any]:
    # No arguments written is a call with none.
    arguments = _json(call.arguments, f"{where}.arguments") if call.arguments else {}
    if not isinstance(arguments, dict):
        _reject(f"{where}.arguments must be a JSON object")
    function = {"name": _function_name(call.name, f"{where}.name"), "arguments": arguments}
    record: dict[str, Any] = {"type": "function", "function": function}
    if call.id:
        record["id"] = call.id
    return record


def _function_name(name: str, where: str) -> str:
    if FUNCTION_NAME.fullmatch(name) is None:
        shown = name if len(name) <= 64 else name[:64] + "..."
        _reject(f"{where} {shown!r} is not a function name (1 to 64 letters, digits, underscores or dashes)")
    return name


def _json(text: str, where: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        _reject(f"{where} is not JSON: {error}")
    except RecursionError:
        _reject(f"{where} is nested too deeply")
    if _depth(value) > MAX_JSON_DEPTH:
        # The template renders it with recursive code (tojson, the schema walk) that a deep
        # enough value would overflow: refused here, by name, instead.
        _reject(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in a JSON value (a scalar: 0), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in children)
    return deepest


def _reject(message: str) -> NoReturn:
    raise RequestRejected(ErrorKind.INVALID, message)
