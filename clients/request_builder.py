"""Keyword arguments -> request messages; shared by the sync and asyncio clients."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, TypeVar

from clients.chat_tools import ToolSpec, tool_call_messages, tool_messages
from protos.splitserve.v1 import generation_pb2 as pb

T = TypeVar("T")
R = TypeVar("R")
# A chat turn as (role, content) or {"role": ..., "content": ...}; the mapping may carry OpenAI's
# "tool_calls" (an assistant's), "tool_call_id" (a tool result's) and "name".
ChatMessage = tuple[str, str] | Mapping[str, Any]
# A chat template variable's value (the scheduler takes plain values only).
TemplateValue = bool | int | float | str


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of generate() and stream() besides the prompt.

    Sampling values left out (or None) stay unset in the request, so the server's defaults
    apply.
    """

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    logit_bias: Mapping[int, float] | None
    allowed_token_ids: Sequence[int] | None
    structured_output: Mapping[str, Any] | None
    ignore_eos: bool | None
    logprobs: int | None
    prompt_logprobs: int | None
    n: int | None
    best_of: int | None
    min_tokens: int | None
    skip_special_tokens: bool | None
    include_stop_str_in_output: bool | None
    add_generation_prompt: bool
    chat_template_kwargs: Mapping[str, TemplateValue] | None
    tools: Sequence[ToolSpec] | None
    priority: int
    request_id: str | None
    cache_salt: str | None
    ttft_deadline_ms: int | None
    tpot_target_ms: int | None


def build_generate_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[ChatMessage] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    logit_bias: Mapping[int, float] | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    structured_output: Mapping[str, Any] | None = None,
    ignore_eos: bool | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    n: int | None = None,
    best_of: int | None = None,
    min_tokens: int | None = None,
    skip_special_tokens: bool | None = None,
    include_stop_str_in_output: bool | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, TemplateValue] | None = None,
    tools: Sequence[ToolSpec] | None = None,
    priority: int = 0,
    request_id: str | None = None,
    cache_salt: str | None = None,
    ttft_deadline_ms: int | None = None,
    tpot_target_ms: int | None = None,
) -> pb.GenerateRequest:
    """Builds a GenerateRequest; raises ValueError for a bad combination or value.

    Exactly one of prompt (text), prompt_token_ids and messages (a chat, rendered with the
    model's template; add_generation_prompt appends the assistant prefix, chat_template_kwargs
    are extra template variables such as {"enable_thinking": False}) must be given.
    skip_special_tokens=False asks for the text of special tokens too;
    include_stop_str_in_output=True ends the text with the stop string that ended it.
    logit_bias adds a bias in [-100, 100] to a token id's logit; allowed_token_ids limits what
    may be generated to those ids. prompt_logprobs=N scores the prompt (each token's logprob
    and N alternatives; max_tokens=0 then scores it alone). n=N generates N choices from one
    prompt computation (each delta names its choice in `index`); best_of=M generates M and keeps
    the n most likely. structured_output constrains the output to a grammar, spelled
    as vLLM's structured_outputs with one key: {"json": schema (a dict or JSON text)},
    {"json_object": True}, {"regex": pattern}, {"choice": [strings]} or {"grammar": EBNF}.
    tools (OpenAI's: [{"type": "function", "function": {"name", "description", "parameters"}}])
    are rendered into a chat's prompt; the answer is text (the model's own call format), which a
    structured_output can constrain to a call. ttft_deadline_ms: most milliseconds from arrival
    to the first token the caller accepts; tpot_target_ms: the mean milliseconds between tokens
    it wants (None or 0: none). Under the priority and fair policies the server serves the
    earliest deadline first; under any, it refuses at once a request it predicts to miss them.
    """
    prompts = {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "messages": messages}
    given = [name for name, value in prompts.items() if value is not None]
    if len(given) != 1:
        raise ValueError(
            "exactly one of prompt, prompt_token_ids and messages must be given, got "
            + (", ".join(given) or "none")
        )
    request = pb.GenerateRequest()
    _checked("priority", lambda v: setattr(request, "priority", v), priority)
    request.request_id = request_id or ""
    request.cache_salt = cache_salt or ""
    for name, value in (("ttft_deadline_ms", ttft_deadline_ms), ("tpot_target_ms", tpot_target_ms)):
        if value is not None:
            _checked(name, lambda v, n=name: setattr(request, n, v), value)
    if prompt is not None:
        request.text = prompt
    elif prompt_token_ids is not None:
        _checked("prompt_token_ids", request.token_ids.ids.extend, list(prompt_token_ids))
    elif messages is not None:
        request.chat.CopyFrom(chat(messages, add_generation_prompt, chat_template_kwargs, tools))
    if messages is None:
        # A text or token-id prompt has no chat to hold them.
        _chat_only(chat_template_kwargs=chat_template_kwargs, tools=tools)

    params = request.sampling
    scalars = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "ignore_eos": ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "n": n,
        "best_of": best_of,
        "min_tokens": min_tokens,
        "include_stop_str_in_output": include_stop_str_in_output,
    }
    for name, value in scalars.items():
        if value is not None:
            _checked(name, lambda v, n=name: setattr(params, n, v), value)
    if skip_special_tokens is not None:
        # The proto inverts it so that its zero value keeps the common behaviour.
        params.keep_special_tokens = not skip_special_tokens
    if stop is not None:
        _checked("stop", params.stop.extend, [stop] if isinstance(stop, str) else list(stop))
    if stop_token_ids is not None:
        _checked("stop_token_ids", params.stop_token_ids.extend, list(stop_token_ids))
    if logit_bias is not None:
        _checked("logit_bias", params.logit_bias.update, dict(logit_bias))
    if allowed_token_ids is not None:
        _checked("allowed_token_ids", params.allowed_token_ids.extend, list(allowed_token_ids))
    if structured_output is not None:
        params.structured_output.CopyFrom(structured_output_message(structured_output))
    # Proto3 creates an empty sampling message on first access; keep it present either way so
    # the server sees "all defaults" explicitly.
    request.sampling.SetInParent()
    return request


def structured_output_message(spec: Mapping[str, Any]) -> pb.StructuredOutput:
    """vLLM's structured_outputs spelling (one key) as the protocol's message; ValueError for
    anything else."""
    if len(spec) != 1:
        raise ValueError(f"structured_output takes exactly one of {sorted(_GRAMMAR_KEYS)}, got {sorted(spec)}")
    (key, value), = spec.items()
    if key not in _GRAMMAR_KEYS:
        raise ValueError(f"structured_output takes exactly one of {sorted(_GRAMMAR_KEYS)}, got {key!r}")
    if key == "json":
        return pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if key == "json_object":
        if value is not True:
            raise ValueError("structured_output json_object must be true")
        return pb.StructuredOutput(json_object=True)
    if key == "choice":
        if isinstance(value, str) or not all(isinstance(choice, str) for choice in value):
            raise ValueError("structured_output choice must be a list of strings")
        return pb.StructuredOutput(choice=pb.Choices(choices=list(value)))
    if not isinstance(value, str):
        raise ValueError(f"structured_output {key} must be a string")
    return pb.StructuredOutput(**{key: value})


# vLLM's names of the kinds of grammar; "json" is the protocol's json_schema.
_GRAMMAR_KEYS = frozenset({"json", "json_object", "regex", "choice", "grammar"})


def build_tokenize_request(
    text: str | None = None,
    messages: Sequence[ChatMessage] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, TemplateValue] | None = None,
    tools: Sequence[ToolSpec] | None = None,
) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("exactly one of text and messages must be given")
    if messages is not None:
        return pb.TokenizeRequest(chat=chat(messages, add_generation_prompt, chat_template_kwargs, tools))
    _chat_only(chat_template_kwargs=chat_template_kwargs, tools=tools)
    return pb.TokenizeRequest(text=text)


def _chat_only(**options: object) -> None:
    """ValueError for a chat option given without a chat."""
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"{name} needs messages (a chat prompt)")


def build_detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool) -> pb.DetokenizeRequest:
    request = pb.DetokenizeRequest(skip_special_tokens=skip_special_tokens)
    _checked("token_ids", request.token_ids.extend, list(token_ids))
    return request


def chat(
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, TemplateValue] | None = None,
    tools: Sequence[ToolSpec] | None = None,
) -> pb.Chat:
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of chat turns")
    return pb.Chat(
        messages=[_chat_message(index, turn) for index, turn in enumerate(messages)],
        add_generation_prompt=add_generation_prompt,
        template_kwargs={name: template_value(name, value) for name, value in (template_kwargs or {}).items()},
        tools=tool_messages(tools or []),
    )


def template_value(name: str, value: TemplateValue) -> pb.TemplateValue:
    """One chat template variable; ValueError for a value that is not plain."""
    # bool first: a bool is also an int.
    if isinstance(value, bool):
        return pb.TemplateValue(bool_value=value)
    if isinstance(value, int):
        return _checked(f"chat_template_kwargs[{name!r}]", lambda v: pb.TemplateValue(int_value=v), value)
    if isinstance(value, float):
        return pb.TemplateValue(float_value=value)
    if isinstance(value, str):
        return pb.TemplateValue(string_value=value)
    raise ValueError(
        f"chat_template_kwargs[{name!r}] is a {type(value).__name__}; values must be booleans, "
        "numbers or strings"
    )


def _chat_message(index: int, turn: ChatMessage) -> pb.ChatMessage:
    if isinstance(turn, tuple):
        role, content = turn
        return pb.ChatMessage(role=role, content=content)
    # An assistant turn that only calls tools has no content (OpenAI sends null).
    message = pb.ChatMessage(role=turn["role"], content=turn.get("content") or "")
    calls = turn.get("tool_calls")
    if calls:
        message.tool_calls.extend(tool_call_messages(calls, f"messages[{index}].tool_calls"))
    _checked(f"messages[{index}].tool_call_id", lambda v: setattr(message, "tool_call_id", v), turn.get("tool_call_id") or "")
    _checked(f"messages[{index}].name", lambda v: setattr(message, "name", v), turn.get("name") or "")
    return message


def _checked(name: str, apply: Callable[[T], R], value: T) -> R:
    """Runs a protobuf assignment, naming the argument when protobuf rejects its value."""
    try:
        return apply(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"invalid {name}: {value!r} ({error})") from None
