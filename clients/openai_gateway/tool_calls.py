"""Tool calls read out of a chat answer as it streams, in OpenAI's shapes.

One parser per answer is fed the answer's text as it arrives (`feed`) and told when it ends
(`finish`); each returns what became final since: content text (str) and pieces of calls
(ToolCallDelta). A response sent whole feeds the whole text at once, so a streamed answer and a
whole one read the same calls and content.

Which parser (tool_choice.py's ToolPlan):
- auto, the model's own format, told apart by the answer itself (tool_call_formats.py):
  `<tool_call>` blocks anywhere in it are Hermes/Qwen calls, the text around them content (held
  back only while it could be the start of a tag); an answer that starts (after whitespace) with
  `{` or `<|python_tag|>` is held whole and read as Llama 3 JSON calls when it is wholly calls,
  else it is content. A block or answer that is not a call of one of the request's functions is
  content, as written. The whitespace between a call and content before it, or calls or the end
  after it, is dropped. With parallel_tool_calls false, calls after the first are dropped.
- required: the constrained JSON array of calls, each sent as soon as its element is complete.
- named: the constrained arguments object, streamed as the call's arguments as it comes.
Each call of auto and required is sent whole in one delta, its arguments as compact JSON.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from clients.openai_gateway.tool_call_formats import (
    PYTHON_TAG,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Call,
    call_of,
    hermes_call,
    llama_json_calls,
)
from clients.openai_gateway.tool_choice import ToolMode, ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True, frozen=True)
class ToolCallDelta:
    """A piece of one call: its first carries the id and the name, every one some arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def body(self) -> dict[str, Any]:
        """The piece as an element of a chunk's delta.tool_calls."""
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        piece: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            piece |= {"id": self.id, "type": "function"}
        return piece | {"function": function}


Event = str | ToolCallDelta


def call_bodies(events: Sequence[Event]) -> list[dict[str, Any]]:
    """The calls' pieces among events, as a chunk's delta.tool_calls."""
    return [event.body() for event in events if isinstance(event, ToolCallDelta)]


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...

    @property
    def made_calls(self) -> bool: ...


def parser_for(plan: ToolPlan | None, new_id: Callable[[], str] = new_call_id) -> ToolCallParser | None:
    """The parser of an answer under this plan; None when its text is only content."""
    if plan is None or plan.mode is ToolMode.NONE:
        return None
    if plan.mode is ToolMode.NAMED:
        assert plan.forced is not None
        return ArgumentsParser(plan.forced, new_id)
    if plan.mode is ToolMode.REQUIRED:
        return CallArrayParser(plan.function_names, new_id)
    return AutoParser(plan.function_names, plan.parallel, new_id)


@dataclass(slots=True)
class Answer:
    """A whole answer read: its content (None when it only calls) and its calls, as a message's."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def read_answer(parser: ToolCallParser, text: str) -> Answer:
    return answer_of(parser.feed(text) + parser.finish())


def answer_of(events: Sequence[Event]) -> Answer:
    """The answer a parser's events make, as a client reassembles a stream of them."""
    content = "".join(event for event in events if isinstance(event, str))
    calls: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ToolCallDelta):
            if event.index == len(calls):
                calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
            calls[event.index]["function"]["arguments"] += event.arguments
    return Answer(None if calls and not content.strip() else content, calls)


class _Mode(Enum):
    START = "start"
    TEXT = "text"
    CALL = "call"
    JSON = "json"


@dataclass(slots=True)
class AutoParser:
    names: frozenset[str]
    parallel: bool
    new_id: Callable[[], str] = new_call_id
    _buffer: str = ""
    _mode: _Mode = _Mode.START
    _calls: int = 0
    _after_call: bool = False
    # The whitespace before an open block: dropped if the block is a call, else content.
    _space_before: str = ""

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._mode is _Mode.START:
                head = self._buffer.lstrip()
                if head.startswith(("{", PYTHON_TAG)):
                    self._mode = _Mode.JSON
                elif final or not PYTHON_TAG.startswith(head):
                    self._mode = _Mode.TEXT
                else:
                    # Only whitespace, or what may still become <|python_tag|>.
                    return events
            elif self._mode is _Mode.JSON:
                if not final:
                    return events
                calls = llama_json_calls(self._buffer, self.names)
                if calls is None:
                    _content(events, self._buffer)
                for call in calls or ():
                    self._call(events, call)
                self._buffer = ""
                return events
            elif self._mode is _Mode.TEXT:
                if self._after_call:
                    # The whitespace after a call goes unless content follows it.
                    head = self._buffer.lstrip()
                    if not head.startswith(TOOL_CALL_OPEN) and not final and TOOL_CALL_OPEN.startswith(head):
                        return events
                    if head.startswith(TOOL_CALL_OPEN) or not head:
                        self._buffer = head
                    self._after_call = False
                start = self._buffer.find(TOOL_CALL_OPEN)
                if start >= 0:
                    text = self._buffer[:start].rstrip()
                    _content(events, text)
                    self._space_before = self._buffer[len(text) : start]
                    self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
                    self._mode = _Mode.CALL
                    continue
                held = 0 if final else _held_back(self._buffer)
                _content(events, self._buffer[: len(self._buffer) - held])
                self._buffer = self._buffer[len(self._buffer) - held :]
                return events
            else:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0 and not final:
                    return events
                # A last block may lack its closing tag: the answer ended after the JSON.
                block = self._buffer if end < 0 else self._buffer[:end]
                call = hermes_call(block, self.names)
                if call is None:
                    _content(events, self._space_before + TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if end >= 0 else ""))
                else:
                    self._call(events, call)
                self._buffer = "" if end < 0 else self._buffer[end + len(TOOL_CALL_CLOSE) :]
                self._mode, self._after_call, self._space_before = _Mode.TEXT, call is not None, ""

    def _call(self, events: list[Event], call: Call) -> None:
        if self._calls and not self.parallel:
            return
        events.append(_whole_call(self._calls, self.new_id(), call))
        self._calls += 1


@dataclass(slots=True)
class CallArrayParser:
    """tool_choice required: `[{"name": ..., "arguments": {...}}, ...]`, as constrained."""

    names: frozenset[str]
    new_id: Callable[[], str] = new_call_id
    _buffer: str = ""
    # Where the text not yet read as calls starts.
    _position: int = 0
    _opened: bool = False
    _done: bool = False
    _calls: int = 0
    _decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while not self._done:
            position = _after_space(self._buffer, self._position)
            if position == len(self._buffer):
                break
            head = self._buffer[position]
            if not self._opened:
                if head != "[":
                    break
                self._opened = True
            elif head == "]":
                self._done = True
            elif head != "," or not self._calls:
                try:
                    value, end = self._decoder.raw_decode(self._buffer, position)
                except (json.JSONDecodeError, RecursionError):
                    # The element is not complete yet (or, at the end, never was).
                    break
                call = call_of(value, self.names)
                if call is None:
                    break
                events.append(_whole_call(self._calls, self.new_id(), call))
                self._calls += 1
                self._position = end
                continue
            self._position = position + 1
        if final and not self._done:
            # Cut short (max_tokens): what was not read as calls is content.
            _content(events, self._buffer[self._position :].strip())
        return events


@dataclass(slots=True)
class ArgumentsParser:
    """A named tool_choice: the whole answer is the call's arguments, as constrained."""

    name: str
    new_id: Callable[[], str] = new_call_id
    _started: bool = False

    @property
    def made_calls(self) -> bool:
        return self._started

    def feed(self, text: str) -> list[Event]:
        if not self._started:
            self._started = True
            return [ToolCallDelta(0, self.new_id(), self.name, text)]
        return [ToolCallDelta(0, None, None, text)] if text else []

    def finish(self) -> list[Event]:
        return [] if self._started else self.feed("")


def _whole_call(index: int, call_id: str, call: Call) -> ToolCallDelta:
    return ToolCallDelta(index, call_id, call.name, json.dumps(call.arguments, ensure_ascii=False))


def _content(events: list[Event], text: str) -> None:
    if text:
        events.append(text)


def _held_back(text: str) -> int:
    """How much of the end of text may not be sent as content yet: a part of a <tool_call> tag,
    and the whitespace before it (dropped if a call follows)."""
    partial = next(
        (size for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1) if text.endswith(TOOL_CALL_OPEN[:size])),
        0,
    )
    sendable = text[: len(text) - partial].rstrip()
    return len(text) - len(sendable)


def _after_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position
