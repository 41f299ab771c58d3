"""Tool calls read out of chat answers as models write them: Hermes/Qwen `<tool_call>` blocks and
Llama 3's JSON calls (tool_choice auto), and the constrained answers of tool_choice required and
named; whole, and streamed in pieces of every size, which must read the same. Then the chat
response's shapes: OpenAI's message.tool_calls and delta.tool_calls, with finish reason
tool_calls."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from clients.openai_gateway.responses import ChatShaper, ResponseContext
from clients.openai_gateway.tool_calls import (
    Answer,
    ToolCallDelta,
    ToolCallParser,
    answer_of,
    parser_for,
    read_answer,
)
from clients.openai_gateway.tool_choice import tool_plan
from clients.results import GenerationDelta, Usage

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
PARIS = {"city": "Paris", "unit": "celsius"}

# Answers as the models write them.
QWEN_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
QWEN_TWO = QWEN_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
QWEN3_THINKING = "<think>\nThe user wants the weather in Paris.\n</think>\n\n" + QWEN_ONE
HERMES_2_PRO = '<tool_call>\n{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}\n</tool_call>'
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA_PYTHON_TAG = "<|python_tag|>" + LLAMA_ONE
LLAMA_TWO = LLAMA_ONE + '; {"name": "get_time", "parameters": {"zone": "Europe/Paris"}}'


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parser(tool_choice: Any = "auto", parallel: bool | None = None) -> ToolCallParser:
    made = parser_for(tool_plan(TOOLS, tool_choice, parallel), ids())
    assert made is not None
    return made


def streamed(make: Any, text: str, size: int) -> Answer:
    """The answer read from pieces of `size` characters, reassembled as a client does."""
    reading = make()
    events = [event for start in range(0, len(text), size) for event in reading.feed(text[start : start + size])]
    events += reading.finish()
    started: set[int] = set()
    for event in events:
        if isinstance(event, ToolCallDelta):
            # A call's id and name come with its first delta only.
            if event.index in started:
                assert event.id is None and event.name is None
            started.add(event.index)
    return answer_of(events)


def read(text: str, tool_choice: Any = "auto", parallel: bool | None = None) -> Answer:
    """The whole answer read, after checking every way of streaming it reads the same."""
    whole = read_answer(parser(tool_choice, parallel), text)
    for size in range(1, len(text) + 1):
        assert streamed(lambda: parser(tool_choice, parallel), text, size) == whole, size
    return whole


def calls_of(answer: Answer) -> list[tuple[str, dict[str, Any]]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in answer.tool_calls]


@pytest.mark.parametrize("text", [QWEN_ONE, HERMES_2_PRO, LLAMA_ONE, LLAMA_PYTHON_TAG, "\n\n" + QWEN_ONE + "\n"])
def test_one_call_in_the_hermes_or_llama_format(text: str) -> None:
    answer = read(text)
    assert calls_of(answer) == [("get_weather", PARIS)]
    assert answer.content is None
    assert answer.tool_calls[0]["id"] == "call_0" and answer.tool_calls[0]["type"] == "function"


@pytest.mark.parametrize("text", [QWEN_TWO, LLAMA_TWO])
def test_parallel_calls(text: str) -> None:
    assert calls_of(read(text)) == [("get_weather", PARIS), ("get_time", {"zone": "Europe/Paris"})]
    # parallel_tool_calls false: the first call only.
    assert calls_of(read(text, parallel=False)) == [("get_weather", PARIS)]


def test_text_around_hermes_calls_is_content() -> None:
    answer = read(QWEN3_THINKING)
    assert answer.content == "<think>\nThe user wants the weather in Paris.\n</think>"
    assert calls_of(answer) == [("get_weather", PARIS)]
    answer = read("Let me look that up.\n" + QWEN_ONE + "\nOne moment.")
    assert answer.content == "Let me look that up.\nOne moment."
    assert calls_of(answer) == [("get_weather", PARIS)]


def test_an_unclosed_last_block_is_still_a_call() -> None:
    """The answer may end (EOS) right after the call's JSON."""
    assert calls_of(read(QWEN_ONE.removesuffix("</tool_call>"))) == [("get_weather", PARIS)]


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        "Use <tool_call> tags to call a function, and <tool",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not a tool offered
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # arguments not an object
        '{"city": "Paris", "unit": "celsius"}',  # JSON, but no call
        '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some text',
        "  indented answer  ",
        "",
    ],
)
def test_what_is_not_a_call_is_content_as_written(text: str) -> None:
    answer = read(text)
    assert answer.tool_calls == [] and answer.content == text


def test_content_is_streamed_before_the_answer_ends() -> None:
    reading = parser()
    assert reading.feed("The capital") == ["The capital"]
    # A possible start of a tag, and the space before it, wait for what follows.
    assert reading.feed(" is <tool") == [" is"]
    assert reading.feed("s>.") == [" <tools>."]
    assert reading.finish() == [] and not reading.made_calls


def test_a_llama_call_is_sent_when_the_answer_ends() -> None:
    reading = parser()
    assert reading.feed(LLAMA_ONE) == []
    (call,) = reading.finish()
    assert isinstance(call, ToolCallDelta) and json.loads(call.arguments) == PARIS and reading.made_calls


def test_required_reads_the_constrained_array_call_by_call() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    answer = read(text, "required")
    assert calls_of(answer) == [("get_weather", {"city": "Paris"}), ("get_time", {})] and answer.content is None
    reading = parser("required")
    # The first call is sent as soon as its element is complete.
    assert reading.feed(text[:20]) == []
    (first,) = reading.feed(text[20:57])
    assert isinstance(first, ToolCallDelta) and first.name == "get_weather"


def test_a_required_array_cut_short_keeps_its_whole_calls() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_ti'
    answer = read(text, "required")
    assert calls_of(answer) == [("get_weather", {"city": "Paris"})]
    assert answer.content == '{"name": "get_ti'


def test_a_named_choice_streams_the_arguments_as_they_come() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = read('{"city": "Paris"}', named)
    assert calls_of(answer) == [("get_weather", {"city": "Paris"})] and answer.content is None
    reading = parser(named)
    first, second = reading.feed('{"ci') + reading.feed('ty": "Paris"}')
    assert (first.id, first.name, first.arguments) == ("call_0", "get_weather", '{"ci')
    assert (second.id, second.name, second.arguments) == (None, None, 'ty": "Paris"}')


def test_tool_choice_none_reads_no_calls() -> None:
    assert parser_for(tool_plan(TOOLS, "none", None)) is None
    assert parser_for(None) is None


# --- the chat response's shapes ----------------------------------------------------------------

CONTEXT = ResponseContext(id="chatcmpl-1", created=0, model="m", include_usage=False, want_logprobs=False)
USAGE = Usage(prompt_tokens=5, completion_tokens=9, cached_prompt_tokens=0)


def deltas(pieces: list[str], reason: str = "stop") -> list[GenerationDelta]:
    last = len(pieces) - 1
    return [
        GenerationDelta("r", [], piece, [], finish_reason=reason if i == last else None, usage=USAGE if i == last else None)
        for i, piece in enumerate(pieces)
    ]


def test_a_whole_response_carries_the_calls_and_finish_reason_tool_calls() -> None:
    shaper = ChatShaper(CONTEXT, parser())
    body = shaper.whole(deltas(["<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n</tool_call>"]))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    }


def test_stream_chunks_carry_tool_call_deltas() -> None:
    shaper = ChatShaper(CONTEXT, parser())
    chunks = [chunk for delta in deltas(["Sure. ", "<tool_call>\n", QWEN_ONE[12:]]) for chunk in shaper.chunks(delta)]
    bodies = [(chunk["choices"][0]["delta"], chunk["choices"][0]["finish_reason"]) for chunk in chunks]
    assert bodies == [
        ({"content": "Sure."}, None),
        (
            {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"arguments": json.dumps(PARIS), "name": "get_weather"}}]},
            "tool_calls",
        ),
    ]


def test_an_answer_without_calls_keeps_its_finish_reason() -> None:
    shaper = ChatShaper(CONTEXT, parser())
    (choice,) = shaper.whole(deltas(["Paris is ", "sunny."], reason="length"))["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Paris is sunny."
    assert "tool_calls" not in choice["message"]
