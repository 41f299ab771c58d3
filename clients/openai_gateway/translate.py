"""HTTP request bodies -> the keyword arguments of AsyncClient.stream.

Only what the caller set is passed on: every sampling field left out stays None, and so unset in
the gRPC request, where the scheduler applies the model's generation_config.json defaults. The
gateway never fills in defaults of its own. Features the API names but this server lacks are
refused here with a 400 that says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from clients.openai_gateway.errors import bad_request, unsupported
from clients.openai_gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseFormat,
    SamplingFields,
)
from clients.openai_gateway.tool_choice import ToolMode, ToolPlan, tool_plan
from clients.request_builder import (
    GenerateOptions,
    TemplateValue,
    structured_output_message,
)

# OpenAI's newer name for the system role; the templates served here know only "system".
ROLE_ALIASES = {"developer": "system"}


@dataclass(slots=True, frozen=True)
class GenerateCall:
    """One Generate call: exactly one of the three prompt forms, and the options; for a chat that
    offers tools, how its answer is read (tool_choice.py)."""

    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[dict[str, Any]] | None
    options: GenerateOptions
    tool_plan: ToolPlan | None = None

    @property
    def request_id(self) -> str:
        return self.options.get("request_id") or ""


def completion_call(body: CompletionRequest, request_id: str) -> GenerateCall:
    _check_common(body)
    if body.echo and (body.n or 1) > 1:
        raise unsupported("echo", "echo is supported with one choice only (n=1)")
    if body.suffix is not None:
        raise unsupported("suffix", "suffix (insertion) is not supported")
    options = _sampling(body, request_id, max_tokens=body.max_tokens, logprobs=body.logprobs)
    if body.best_of is not None:
        options["best_of"] = body.best_of
    if body.echo and (body.logprobs is not None or body.max_tokens == 0):
        # The echoed prompt's tokens are scored as the completion's are; with max_tokens 0 the
        # prompt is all there is (how evaluation harnesses score text).
        options["prompt_logprobs"] = body.logprobs or 0
    prompt = _single_prompt(body.prompt)
    if isinstance(prompt, str):
        return GenerateCall(prompt, None, None, options)
    return GenerateCall(None, prompt, None, options)


def chat_call(body: ChatCompletionRequest, request_id: str) -> GenerateCall:
    _check_common(body)
    # OpenAI's deprecated spelling of tools.
    if body.functions or body.function_call not in (None, "none"):
        name = "functions" if body.functions else "function_call"
        raise unsupported(name, f"{name} is not supported; use tools and tool_choice")
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens.
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    options = _sampling(body, request_id, max_tokens=max_tokens, logprobs=logprobs)
    formatted = _response_format(body.response_format)
    if formatted is not None:
        if body.structured_outputs is not None:
            raise bad_request("give response_format or structured_outputs, not both", "response_format")
        options["structured_output"] = formatted
    if plan is not None and plan.constraint is not None:
        if options.get("structured_output") is not None:
            raise bad_request(
                f"tool_choice {plan.mode.value} constrains the answer to a call; leave out response_format "
                "and structured_outputs",
                "tool_choice",
            )
        options["structured_output"] = plan.constraint
    if plan is not None and plan.mode is not ToolMode.NONE:
        # tool_choice none leaves the tools out of the prompt: the model is not invited to call.
        options["tools"] = body.tools
    if body.add_generation_prompt is not None:
        options["add_generation_prompt"] = body.add_generation_prompt
    if body.chat_template_kwargs is not None:
        options["chat_template_kwargs"] = template_kwargs(body.chat_template_kwargs)
    return GenerateCall(None, None, chat_messages(body.messages), options, plan)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The turns as the scheduler takes them: text content, OpenAI's role aliases resolved, an
    assistant's calls and a tool result's call id and name as they came (the client library
    checks their shape)."""
    return [_chat_turn(index, message) for index, message in enumerate(messages)]


def template_kwargs(variables: dict[str, Any]) -> dict[str, TemplateValue]:
    """chat_template_kwargs as the scheduler takes them: plain JSON values only. Which names are
    allowed, and how many, is the scheduler's to say (for gRPC callers alike)."""
    for name, value in variables.items():
        if not isinstance(value, (bool, int, float, str)):
            raise bad_request(
                f"chat_template_kwargs.{name} must be a boolean, a number or a string, not "
                f"{'null' if value is None else type(value).__name__}",
                f"chat_template_kwargs.{name}",
            )
    return variables


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a request: text or token ids, alone or as a list of one."""
    if isinstance(prompt, str):
        return prompt
    if not prompt or isinstance(prompt[0], int):
        # pydantic matched one member of the union, so the list is all ids.
        return cast(list[int], prompt)
    if len(prompt) != 1:
        # OpenAI answers a batch with one choice per prompt, in one response: not supported.
        raise unsupported(
            "prompt", "several prompts in one request are not supported; send one request per prompt"
        )
    return prompt[0]


def _check_common(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def _sampling(
    body: SamplingFields, request_id: str, *, max_tokens: int | None, logprobs: int | None
) -> GenerateOptions:
    options = GenerateOptions(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        # vLLM (and its clients) spell "all tokens" -1; the API spells it 0.
        top_k=0 if body.top_k == -1 else body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        logit_bias=_logit_bias(body.logit_bias),
        allowed_token_ids=body.allowed_token_ids,
        structured_output=_structured_outputs(body.structured_outputs),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        n=body.n,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        cache_salt=body.cache_salt,
        ttft_deadline_ms=body.ttft_deadline_ms,
        tpot_target_ms=body.tpot_target_ms,
        # The response's id, so the scheduler's log lines name the same request.
        request_id=request_id,
    )
    if body.priority is not None:
        options["priority"] = body.priority
    return options


def _response_format(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """OpenAI's response_format as a structured_output (None for plain text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        return {"json": spec.json_schema}
    raise unsupported(
        "response_format",
        f"response_format {response_format.type!r} is not supported (text, json_object or json_schema)",
    )


def _structured_outputs(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's structured_outputs, checked for its shape; the scheduler compiles the grammar."""
    if spec is None:
        return None
    try:
        structured_output_message(spec)
    except ValueError as error:
        raise bad_request(str(error), "structured_outputs") from None
    return spec


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings; the scheduler checks the ids
    and the values' range."""
    if bias is None:
        return None
    ids: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        ids[int(key)] = value
    return ids


def _chat_turn(index: int, message: ChatMessage) -> dict[str, Any]:
    role = ROLE_ALIASES.get(message.role, message.role)
    turn: dict[str, Any] = {"role": role, "content": _text_content(index, message)}
    if message.tool_calls:
        turn["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    # A tool result's name is the function's, which some templates print; another turn's is a
    # participant's, which the templates served here have no place for.
    if message.name and role == "tool":
        turn["name"] = message.name
    return turn


def _text_content(index: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        # An assistant turn that only calls tools has none.
        if message.tool_calls:
            return ""
        raise bad_request(f"messages[{index}].content is required", f"messages.{index}.content")
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part_index, part in enumerate(content):
        param = f"messages.{index}.content.{part_index}"
        if part.type != "text":
            raise unsupported(param, f"content parts of type {part.type!r} are not supported (only 'text')")
        if part.text is None:
            raise bad_request(f"{param}: a text part needs its text", param)
        texts.append(part.text)
    # Parts joined by newlines, as vLLM renders a multi-part text message.
    return "\n".join(texts)
