"""Tools in a chat whose template does not render them: a Hermes-style rendering in plain turns.

A template that mentions `tools` (Qwen's, Llama 3.1's, Hermes') is given the tools, the calls and
the results as transformers passes them, and renders them its own way. One that does not (the
default SmolLM2's) would drop them silently, so the conversation is rewritten into turns any
template renders, in the Hermes/Qwen form that the gateway's tool-call parser reads back:

- the tools are listed, one JSON signature a line, inside <tools></tools> in a system message
  (HERMES_TOOLS_PROMPT, after the caller's own system message when the chat starts with one),
  which asks for each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>;
- an assistant turn's calls are written after its content in that same form;
- tool results become a user turn holding each result inside <tool_response></tool_response>
  (consecutive results in one turn, as Qwen's template writes them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Qwen2.5's and Qwen3's own wording of the Hermes tool prompt, so a model tuned on either reads
# the fallback as it reads its own template; {tools} is one JSON signature a line.
HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_TOOLS_WORD = re.compile(r"\btools\b")


def template_renders_tools(template: str | Mapping[str, str] | None) -> bool:
    """Whether a chat template (or any of a tokenizer's named templates: transformers picks its
    "tool_use" one when tools are given) reads the `tools` variable."""
    if template is None:
        return False
    texts = [template] if isinstance(template, str) else list(template.values())
    return any(_TOOLS_WORD.search(text) for text in texts)


def hermes_conversation(conversation: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as plain role/content turns, tools, calls and results written into them.

    tools are as transformers takes them ({"type": "function", "function": {...}}); turns as
    encode_chat builds them (calls' arguments as objects)."""
    turns: list[dict[str, Any]] = []
    for turn in conversation:
        role, content = turn["role"], turn["content"]
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if turns and turns[-1].get("tool_results"):
                turns[-1]["content"] += "\n" + response
            else:
                # Marked so that the next result joins it; the mark is dropped below.
                turns.append({"role": "user", "content": response, "tool_results": True})
            continue
        calls = [_call_text(call["function"]) for call in turn.get("tool_calls") or ()]
        turns.append({"role": role, "content": "\n".join(([content] if content else []) + calls)})
    plain = [{"role": turn["role"], "content": turn["content"]} for turn in turns]
    if not tools:
        return plain
    listing = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    if plain and plain[0]["role"] == "system":
        return [{"role": "system", "content": f"{plain[0]['content']}\n\n{listing}"}, *plain[1:]]
    return [{"role": "system", "content": listing}, *plain]


def _call_text(function: Mapping[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
