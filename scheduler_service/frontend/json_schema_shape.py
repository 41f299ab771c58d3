"""Whether a tool's parameters are shaped as a JSON schema, checked before they reach a prompt.

A chat template prints the schema as it is, so a misspelt type or a `properties` that is a list
would reach the model unnoticed (and a grammar built from it would fail only later, if one is).
The keywords whose values have a fixed shape in JSON Schema (draft 2020-12 and the earlier ones
that tools are written in) are checked, recursively; other keywords are left alone, as a schema
may carry its own annotations.
"""

from __future__ import annotations

import json
from typing import Any

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Keywords whose value is one schema, a map of schemas, or a list of schemas.
ONE_SCHEMA = frozenset(
    {"additionalProperties", "not", "contains", "propertyNames", "additionalItems", "if", "then", "else",
     "unevaluatedProperties", "unevaluatedItems"}
)
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMA_LISTS = frozenset({"anyOf", "allOf", "oneOf", "prefixItems"})
COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains"})
NUMBERS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
STRINGS = frozenset({"title", "description", "pattern", "format", "$ref", "$schema", "$id"})
# Deeper than any schema written by hand; keeps the walk's recursion bounded.
MAX_DEPTH = 32


def schema_problem(schema: Any) -> str | None:
    """What is wrong with the shape of a tool's parameters schema, naming where; None if nothing."""
    if not isinstance(schema, dict):
        return f"must be a JSON object, not {_json_type(schema)}"
    return _problem(schema, "", 0)


def _problem(schema: Any, path: str, depth: int) -> str | None:
    where = path or "the schema"
    if isinstance(schema, bool):
        # true and false are schemas (anything, nothing).
        return None
    if not isinstance(schema, dict):
        return f"{where} must be a schema (an object or a boolean), not {_json_type(schema)}"
    if depth > MAX_DEPTH:
        return f"{where} is nested deeper than {MAX_DEPTH} schemas"
    for key, value in schema.items():
        at = f"{path}.{key}" if path else key
        problem = _keyword_problem(key, value, at, depth)
        if problem is not None:
            return problem
    return None


def _keyword_problem(key: str, value: Any, at: str, depth: int) -> str | None:
    if key == "type":
        names = value if isinstance(value, list) else [value]
        unknown = [name for name in names if not (isinstance(name, str) and name in TYPES)]
        if unknown or not names:
            return f"{at}: {json_text(value)} is not a JSON Schema type (one of {', '.join(sorted(TYPES))}, or a list of them)"
    elif key == "required":
        if not (isinstance(value, list) and all(isinstance(name, str) for name in value)):
            return f"{at} must be a list of property names"
    elif key == "enum" and not isinstance(value, list):
        return f"{at} must be a list"
    elif key in COUNTS and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return f"{at} must be a non-negative integer"
    elif key in NUMBERS and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{at} must be a number"
    elif key in STRINGS and not isinstance(value, str):
        return f"{at} must be a string"
    elif key in ONE_SCHEMA:
        return _problem(value, at, depth + 1)
    elif key in SCHEMA_MAPS:
        if not isinstance(value, dict):
            return f"{at} must be an object of schemas"
        return _first(_problem(item, f"{at}.{name}", depth + 1) for name, item in value.items())
    elif key in SCHEMA_LISTS:
        if not (isinstance(value, list) and value):
            return f"{at} must be a non-empty list of schemas"
        return _first(_problem(item, f"{at}[{index}]", depth + 1) for index, item in enumerate(value))
    elif key == "items":
        # A list of schemas is how drafts before 2020-12 spelled prefixItems.
        if isinstance(value, list):
            return _first(_problem(item, f"{at}[{index}]", depth + 1) for index, item in enumerate(value))
        return _problem(value, at, depth + 1)
    return None


def _first(problems: Any) -> str | None:
    return next((problem for problem in problems if problem is not None), None)


def json_text(value: Any) -> str:
    """A value as a client wrote it (JSON), cut short."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:40] + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
