"""The tool-call formats models write, read from finished pieces of text: a call is a JSON object
naming one of the request's functions, with its arguments an object.

- Hermes/Qwen: the JSON inside a `<tool_call>...</tool_call>` block, {"name", "arguments"}.
- Llama 3 (3.1, 3.2, 3.3 with JSON tools): the whole answer, {"name", "parameters"}, several
  separated by ";", optionally after `<|python_tag|>`.

Either key is taken in either format, as models trained on one often write the other.
"""

from __future__ import annotations

import json
from collections.abc import Set
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(slots=True, frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


def call_of(value: Any, names: Set[str]) -> Call | None:
    """The call a parsed JSON value is, or None. Keys beyond the name, the arguments and a
    "type": "function" make it some other object."""
    if not isinstance(value, dict) or value.get("name") not in names or value.get("type", "function") != "function":
        return None
    present = [key for key in ARGUMENT_KEYS if key in value]
    if len(present) > 1 or set(value) - {"name", "type", *present}:
        return None
    arguments = value[present[0]] if present else {}
    return Call(value["name"], arguments) if isinstance(arguments, dict) else None


def hermes_call(block: str, names: Set[str]) -> Call | None:
    """The call inside one <tool_call> block (the text between the tags), or None."""
    try:
        return call_of(json.loads(block), names)
    except (json.JSONDecodeError, RecursionError):
        return None


def llama_json_calls(text: str, names: Set[str]) -> list[Call] | None:
    """The calls a whole Llama 3 JSON answer holds, or None when it is not wholly calls."""
    rest = text.strip().removeprefix(PYTHON_TAG)
    decoder = json.JSONDecoder()
    calls: list[Call] = []
    position = _after_space(rest, 0)
    while True:
        try:
            value, position = decoder.raw_decode(rest, position)
        except (json.JSONDecodeError, RecursionError):
            return None
        call = call_of(value, names)
        if call is None:
            return None
        calls.append(call)
        position = _after_space(rest, position)
        if position == len(rest):
            return calls
        if rest[position] != ";":
            return None
        position = _after_space(rest, position + 1)


def _after_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position
