"""OpenAI's tools and tool calls as the protocol's Tool and ToolCall messages.

Tools are given as OpenAI writes them, {"type": "function", "function": {"name", "description",
"parameters"}}; a call as {"id", "type": "function", "function": {"name", "arguments"}}, its
arguments JSON text (as OpenAI returns them) or an object. Shapes that are not these raise
ValueError naming the entry; what the server checks itself (names, schemas, arguments that parse)
is left to it, so gRPC callers and the gateway get the same answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from protos.splitserve.v1 import generation_pb2 as pb

# A tool as OpenAI's API writes it.
ToolSpec = Mapping[str, Any]


def tool_messages(tools: Sequence[ToolSpec]) -> list[pb.Tool]:
    if isinstance(tools, (str, bytes, Mapping)):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}} entries")
    return [_tool(index, tool) for index, tool in enumerate(tools)]


def tool_call_messages(calls: Sequence[Mapping[str, Any]], where: str) -> list[pb.ToolCall]:
    return [_call(f"{where}[{index}]", call) for index, call in enumerate(calls)]


def _tool(index: int, tool: ToolSpec) -> pb.Tool:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise ValueError(f"{where}: only function tools are supported (type 'function'), got {kind!r}")
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function must be an object with a name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ValueError(f"{where}.function.parameters must be a JSON schema (an object)")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    return pb.Tool(
        name=function["name"],
        description=description or "",
        parameters="" if parameters is None else json.dumps(parameters, ensure_ascii=False),
    )


def _call(where: str, call: Mapping[str, Any]) -> pb.ToolCall:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    if call.get("type", "function") != "function":
        raise ValueError(f"{where}: only function calls are supported (type 'function'), got {call.get('type')!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, Mapping):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif arguments is None:
        arguments = ""
    elif not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments must be JSON text or an object")
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise ValueError(f"{where}.id must be a string")
    return pb.ToolCall(id=call_id, name=function["name"], arguments=arguments)
