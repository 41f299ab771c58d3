"""The JSON bodies the gateway accepts, named as OpenAI's API names them, plus vLLM's extra
sampling fields. Every field defaults to None so that what a caller leaves out stays unset all
the way to the scheduler, which then applies the model's own defaults.

Fields outside these models are refused (extra="forbid"): a feature this server does not have
must fail loudly rather than be dropped. Fields OpenAI defines but that only some values of are
supported (echo beside n > 1, tool_choice, ...) are declared here and checked in translate.py, which can say
why. Fields that change nothing a server returns (user, store, metadata, service_tier) are taken
and ignored, as OpenAI's clients send them routinely.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# The protocol's milliseconds fields are uint32.
MAX_MILLISECONDS = 2**32 - 1


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Body):
    include_usage: bool | None = None


class ContentPart(BaseModel):
    # Other part types (image_url, input_audio, file) carry other fields; they are let through
    # here so translate.py can refuse them by name instead of with a schema mismatch.
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(Body):
    role: str
    content: str | list[ContentPart] | None = None
    # A tool result's: the function's name, given to the chat template. Another turn's: a
    # participant's, which the templates served here have no place for (ignored).
    name: str | None = None
    # An assistant turn's calls: [{"id", "type": "function", "function": {"name", "arguments"}}].
    tool_calls: list[dict[str, Any]] | None = None
    # A tool result's: the id of the call it answers.
    tool_call_id: str | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # Followed strictly whatever this says: the server constrains every json_schema output.
    strict: bool | None = None


class ResponseFormat(Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(Body):
    """What both endpoints share: the model, sampling, stop conditions and streaming."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI uses it for abuse monitoring only; it changes nothing in the output.
    user: str | None = None
    # vLLM's extra fields (sent by the openai package through extra_body).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's structured outputs: one of json, json_object, regex, choice, grammar.
    structured_outputs: dict[str, Any] | None = None
    # splitserve's own (extra_body too): most milliseconds to the first token, and the mean
    # milliseconds between tokens, the caller accepts. A request predicted to miss them is
    # refused at once (429 with Retry-After); 0: none.
    ttft_deadline_ms: int | None = Field(default=None, ge=0, le=MAX_MILLISECONDS)
    tpot_target_ms: int | None = Field(default=None, ge=0, le=MAX_MILLISECONDS)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # Number of most likely alternatives per token, as the legacy completions API takes it.
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's: False renders the chat without the assistant prefix.
    add_generation_prompt: bool | None = None
    # vLLM's: extra chat template variables, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # Ignored: stored completions, request tags, processing tiers and reasoning budgets are not
    # things this server has.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None


class TokenizeRequest(Body):
    """vLLM's /tokenize body: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a prompt, false for messages (the template writes its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(Body):
    """vLLM's /detokenize body."""

    model: str | None = None
    tokens: list[int]
