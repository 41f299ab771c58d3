"""OpenAI's tools, tool_choice and parallel_tool_calls -> what the request renders, how its output
is constrained, and how the answer is read back (ToolPlan).

- "none": the tools are not rendered (the model is not invited to call one) and the answer is
  text; earlier calls and results in the messages are still rendered.
- "auto" (the default with tools): the tools are rendered and the model's own output is parsed
  for calls (tool_calls.py says which formats).
- "required": the output is constrained to a JSON array of {"name", "arguments"} objects, each
  naming one of the tools with arguments that follow its parameters schema; one element only when
  parallel_tool_calls is false.
- a named function ({"type": "function", "function": {"name": ...}}): the output is constrained to
  that function's arguments object, following its parameters schema.

The constraints are json_schema structured outputs, so the scheduler compiles them as any other
(a schema it cannot compile is a 400 naming the problem) and the arguments always parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from clients.chat_tools import tool_messages
from clients.openai_gateway.errors import bad_request

# What a function without parameters takes.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolMode(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(slots=True, frozen=True)
class ToolPlan:
    mode: ToolMode
    # The functions offered, by name: what an answer may call.
    function_names: frozenset[str]
    # The function a named choice forces; None otherwise.
    forced: str | None
    parallel: bool
    # The structured_output that forces the call (required and named), else None.
    constraint: dict[str, Any] | None


def tool_plan(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel_tool_calls: bool | None
) -> ToolPlan | None:
    """The plan of a chat request; None when it offers no tools (and chooses none). A 400 naming
    what is wrong."""
    if not tools:
        # parallel_tool_calls alone is harmless: OpenAI's clients send it routinely.
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    try:
        tool_messages(tools)
    except ValueError as error:
        raise bad_request(str(error), "tools") from None
    functions = {tool["function"]["name"]: tool["function"].get("parameters") or NO_PARAMETERS for tool in tools}
    parallel = parallel_tool_calls is not False
    names = frozenset(functions)
    if tool_choice in (None, "auto"):
        return ToolPlan(ToolMode.AUTO, names, None, parallel, None)
    if tool_choice == "none":
        return ToolPlan(ToolMode.NONE, names, None, parallel, None)
    if tool_choice == "required":
        return ToolPlan(ToolMode.REQUIRED, names, None, parallel, {"json": _calls_schema(functions, parallel)})
    name = _named(tool_choice)
    if name not in functions:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not among the tools ({', '.join(sorted(functions))})",
            "tool_choice",
        )
    return ToolPlan(ToolMode.NAMED, names, name, parallel, {"json": functions[name]})


def _named(tool_choice: str | dict[str, Any]) -> str:
    if isinstance(tool_choice, str):
        raise bad_request(
            f"tool_choice {tool_choice!r} is not one of 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(
            f"tool_choice {json.dumps(tool_choice)[:80]} is not {{'type': 'function', 'function': {{'name': ...}}}}",
            "tool_choice",
        )
    return function["name"]


def _calls_schema(functions: dict[str, Any], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each {"name": one of the functions, "arguments": its schema}.

    A parameters schema with references ($ref, as pydantic writes nested models into $defs)
    means them from its own root: nested under a call they would resolve against the array's.
    Such a schema moves whole to the root's $defs under its function's name, its references
    repointed there, and the call's arguments refer to it."""
    definitions: dict[str, Any] = {}
    calls = []
    for name, parameters in functions.items():
        arguments = parameters
        if _has_references(parameters):
            definitions[name] = _repointed(parameters, f"#/$defs/{name}")
            arguments = {"$ref": f"#/$defs/{name}"}
        calls.append(
            {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments}, "required": ["name", "arguments"]}
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def _has_references(schema: Any) -> bool:
    pending = [schema]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                return True
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def _repointed(schema: Any, root: str) -> Any:
    """The schema with each local reference ("#...") made to start at `root` instead."""
    if isinstance(schema, list):
        return [_repointed(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {key: _repointed(value, root) for key, value in schema.items()}
    reference = schema.get("$ref")
    if isinstance(reference, str) and reference.startswith("#"):
        moved["$ref"] = root + reference[1:]
    return moved
