"""Response bodies and stream chunks in OpenAI's shapes, built from the client's deltas.

A shaper turns one request's deltas into either the whole response (`whole`) or the chunks of
its event stream (`opening`, `chunks`, `closing`); the completions and chat shapers differ only
in the shapes. Each shapes one choice; with n > 1 a ChoiceShapers gives every choice its own (a
choice's text, logprob offsets and tool calls are its own) and joins them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from clients.openai_gateway.errors import GatewayError
from clients.openai_gateway.logprobs import CompletionLogprobs, chat_logprobs
from clients.openai_gateway.tool_calls import ToolCallParser, call_bodies, read_answer
from clients.results import GenerationDelta, GenerationResult, ResultAssembler, Usage


@dataclass(slots=True, frozen=True)
class ResponseContext:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str
    include_usage: bool
    want_logprobs: bool

    def header(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }


class Shaper(Protocol):
    def whole(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]: ...

    def opening(self) -> list[dict[str, Any]]: ...

    def chunks(self, delta: GenerationDelta) -> list[dict[str, Any]]: ...

    def closing(self, usage: Usage | None) -> list[dict[str, Any]]: ...


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def total_usage(usages: Sequence[Usage | None]) -> Usage | None:
    """The usage of a response with several choices: the prompt once, every choice's tokens."""
    known = [usage for usage in usages if usage is not None]
    if not known:
        return None
    first = known[0]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in known), first.cached_prompt_tokens)


def finish_reason(delta: GenerationDelta) -> str | None:
    """OpenAI's finish reason; a request the server aborted (shutdown, an operator's Abort) has
    none there, so it ends as an error the client may retry."""
    if delta.finish_reason == "abort":
        raise GatewayError(503, "the server aborted the request", code="aborted")
    return delta.finish_reason


def assemble(deltas: Sequence[GenerationDelta], want_logprobs: bool) -> GenerationResult:
    assembler = ResultAssembler(want_logprobs=want_logprobs)
    for delta in deltas:
        assembler.add(delta)
    return assembler.result()


def _stream_chunk(context: ResponseContext, object_name: str, choice: dict[str, Any]) -> dict[str, Any]:
    chunk = {**context.header(object_name), "choices": [choice]}
    if context.include_usage:
        # OpenAI: with include_usage every chunk has a usage field, null but on the last one.
        chunk["usage"] = None
    return chunk


def _usage_chunk(context: ResponseContext, object_name: str, usage: Usage | None) -> list[dict[str, Any]]:
    if not context.include_usage:
        return []
    return [{**context.header(object_name), "choices": [], "usage": usage_body(usage)}]


@dataclass(slots=True)
class CompletionShaper:
    """echo: the prompt's text, which the answer then begins with (its tokens lead the logprobs,
    the first with null entries: logprobs.echo_first)."""

    context: ResponseContext
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    echo: str | None = None

    def whole(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]:
        result = assemble(deltas, self.context.want_logprobs)
        reason = finish_reason(deltas[-1])
        choice = {
            "index": deltas[-1].index,
            "text": (self.echo or "") + result.text,
            "logprobs": self.logprobs.whole(list(deltas)) if self.context.want_logprobs else None,
            "finish_reason": reason,
        }
        return {
            **self.context.header("text_completion"),
            "choices": [choice],
            "usage": usage_body(result.usage),
        }

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, delta: GenerationDelta) -> list[dict[str, Any]]:
        reason = finish_reason(delta)
        echo, self.echo = self.echo or "", None
        if not (echo or delta.text) and reason is None and not (self.context.want_logprobs and delta.logprobs):
            return []
        choice = {
            "index": delta.index,
            "text": echo + delta.text,
            "logprobs": self.logprobs.fragment(delta) if self.context.want_logprobs else None,
            "finish_reason": reason,
        }
        return [_stream_chunk(self.context, "text_completion", choice)]

    def closing(self, usage: Usage | None) -> list[dict[str, Any]]:
        return _usage_chunk(self.context, "text_completion", usage)


@dataclass(slots=True)
class ChatShaper:
    """tool_calls: reads the calls out of the answer when it may make some (tool_calls.py); the
    finish reason of an answer that made one and stopped is "tool_calls"."""

    context: ResponseContext
    tool_calls: ToolCallParser | None = None

    def whole(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]:
        result = assemble(deltas, self.context.want_logprobs)
        reason = finish_reason(deltas[-1])
        message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
        if self.tool_calls is not None:
            answer = read_answer(self.tool_calls, result.text)
            message["content"] = answer.content
            if answer.tool_calls:
                message["tool_calls"] = answer.tool_calls
            reason = self._with_calls(reason)
        choice = {
            "index": deltas[-1].index,
            "message": message,
            "logprobs": chat_logprobs(result.logprobs) if result.logprobs is not None else None,
            "finish_reason": reason,
        }
        return {
            **self.context.header("chat.completion"),
            "choices": [choice],
            "usage": usage_body(result.usage),
        }

    def opening(self) -> list[dict[str, Any]]:
        # OpenAI's first chunk names the role, with empty content.
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [_stream_chunk(self.context, "chat.completion.chunk", choice)]

    def chunks(self, delta: GenerationDelta) -> list[dict[str, Any]]:
        reason = finish_reason(delta)
        with_logprobs = self.context.want_logprobs and bool(delta.logprobs)
        body: dict[str, Any] = {"content": delta.text} if delta.text else {}
        if self.tool_calls is not None:
            events = self.tool_calls.feed(delta.text)
            if reason is not None:
                events += self.tool_calls.finish()
                reason = self._with_calls(reason)
            content = "".join(event for event in events if isinstance(event, str))
            calls = call_bodies(events)
            body = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        if not body and reason is None and not with_logprobs:
            return []
        choice = {
            "index": delta.index,
            "delta": body,
            "logprobs": chat_logprobs(delta.logprobs) if with_logprobs else None,
            "finish_reason": reason,
        }
        return [_stream_chunk(self.context, "chat.completion.chunk", choice)]

    def _with_calls(self, reason: str | None) -> str | None:
        assert self.tool_calls is not None
        return "tool_calls" if reason == "stop" and self.tool_calls.made_calls else reason

    def closing(self, usage: Usage | None) -> list[dict[str, Any]]:
        return _usage_chunk(self.context, "chat.completion.chunk", usage)


@dataclass(slots=True)
class ChoiceShapers:
    """Several choices (n > 1): each choice's deltas (by their index) go to a shaper of its own,
    made by `make`; whole bodies join the choices, in index order, under one usage (the prompt
    once, every choice's tokens)."""

    make: Callable[[], Shaper]
    num_choices: int
    _shapers: dict[int, Shaper] = field(default_factory=dict)

    def whole(self, deltas: Sequence[GenerationDelta]) -> dict[str, Any]:
        by_choice: dict[int, list[GenerationDelta]] = {}
        for delta in deltas:
            by_choice.setdefault(delta.index, []).append(delta)
        bodies = [self._shaper(index).whole(by_choice[index]) for index in sorted(by_choice)]
        # Each choice's usage comes with its last delta, as assemble takes it.
        usages = [by_choice[index][-1].usage for index in sorted(by_choice)]
        return {**bodies[0], "choices": [body["choices"][0] for body in bodies], "usage": usage_body(total_usage(usages))}

    def opening(self) -> list[dict[str, Any]]:
        chunks = []
        for index in range(self.num_choices):
            for chunk in self._shaper(index).opening():
                chunk["choices"][0]["index"] = index
                chunks.append(chunk)
        return chunks

    def chunks(self, delta: GenerationDelta) -> list[dict[str, Any]]:
        return self._shaper(delta.index).chunks(delta)

    def closing(self, usage: Usage | None) -> list[dict[str, Any]]:
        return self._shaper(0).closing(usage)

    def _shaper(self, index: int) -> Shaper:
        shaper = self._shapers.get(index)
        if shaper is None:
            shaper = self._shapers[index] = self.make()
        return shaper
