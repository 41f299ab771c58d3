"""Turns a client's GenerateRequest into a scheduler Request, or says exactly what is wrong.

Caps are checked first, on the parsed message (frontend/intake_limits.py), and a text prompt
that certainly holds more tokens than the model's length is refused from its length alone
(text/token_count_bound.py): neither costs any tokenizing. A request's tokenizing, chat
templating and block hashing then run in the tokenizer pool (text/tokenizer_pool.py), smallest
prompt first, with a thread that large prompts never take, so neither the event loop that serves
every other stream nor a small prompt waits on a large one. Tiny requests are built inline, where
a thread hop would cost more than the work.

A request too large to parse on the event loop comes unparsed (frontend/message_parsing.py): it is
parsed, checked and built in the pool, its token-id list counted before it is decoded
(frontend/request_parsing.py).
"""

import uuid

from google.protobuf.message import Message
from jinja2 import TemplateError

from kv_manager.prefix_hash import prefix_hashes
from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingDefaults, SamplingParams
from scheduler_service.frontend.chat_turns import chat_input
from scheduler_service.frontend.intake_limits import (
    IntakeLimits,
    chat_texts,
    check_generate,
    check_prompt,
)
from scheduler_service.frontend.request_parsing import UnparsedRequest, parse_request
from scheduler_service.structured.grammars import Grammars
from scheduler_service.structured.spec_codec import spec_from_proto
from scheduler_service.text.template_kwargs import TemplateValue
from scheduler_service.text.tokenizer import TextProcessor
from scheduler_service.text.tokenizer_pool import TokenizerPool

# Up to this many characters of prompt text (well under a millisecond of tokenizing) or this many
# token ids, a request is built on the event loop.
INLINE_TEXT_CHARS = 512
INLINE_TOKEN_IDS = 16_384
# What the intake parses itself when large (MessageParsingInterceptor hands those over unparsed).
PARSED_BY_INTAKE: frozenset[type[Message]] = frozenset({pb.GenerateRequest, pb.TokenizeRequest, pb.DetokenizeRequest})


class Intake:
    """Builds requests for the Generation servicer: caps inline, the rest inline or in the
    tokenizer pool."""

    def __init__(
        self,
        text: TextProcessor | None,
        limits: IntakeLimits,
        defaults: SamplingDefaults = SamplingDefaults(),
        grammars: Grammars | None = None,
    ) -> None:
        self.text = text
        self.limits = limits
        self.defaults = defaults
        # Shared with the planner when both roles run in one process: a grammar compiles once,
        # and one that cannot is refused before the request is queued. A tier's front-end has
        # none: its planner compiles (tier/planner_servicer.py) and refuses the request the same
        # way, so the front-end needs neither xgrammar nor the torch it imports.
        self.grammars = grammars
        self._pool = TokenizerPool(limits.tokenizer_threads)

    async def generate_request(
        self, message: pb.GenerateRequest | UnparsedRequest, info: executor_pb2.ExecutorInfo
    ) -> Request:
        request = await self._generate_request(message, info)
        # A grammar that cannot compile is the client's error, answered before the request runs.
        spec = request.sampling.structured_output
        if spec is not None and self.grammars is not None:
            await self.grammars.compile(spec, info.vocab_size)
        return request

    async def _generate_request(
        self, message: pb.GenerateRequest | UnparsedRequest, info: executor_pb2.ExecutorInfo
    ) -> Request:
        if isinstance(message, UnparsedRequest):
            return await self._pool.run(len(message.raw), self._generate_unparsed, message, info)
        check_generate(message, self.limits, info.max_model_len)
        refuse_certain_overflow(message, self.text, info.max_model_len)
        size = prompt_size(message, "prompt")
        if _is_inline(message, "prompt", size):
            return build_request(message, self.text, info, self.defaults)
        return await self._pool.run(size, build_request, message, self.text, info, self.defaults)

    async def token_ids(self, message: pb.TokenizeRequest | UnparsedRequest, max_model_len: int | None) -> list[int]:
        # Tokenize may run before any executor is reached: the token count is then capped by
        # the flag alone.
        most = max_model_len or self.limits.max_prompt_tokens
        if isinstance(message, UnparsedRequest):
            return await self._pool.run(len(message.raw), self._token_ids_unparsed, message, most)
        check_prompt(message, "input", self.limits, most)
        size = prompt_size(message, "input")
        if _is_inline(message, "input", size):
            return prompt_token_ids(message, self.text, "input")
        return await self._pool.run(size, prompt_token_ids, message, self.text, "input")

    async def text_of(self, message: pb.DetokenizeRequest | UnparsedRequest, vocab_size: int | None) -> str:
        """The text of token ids; vocab_size (None before any executor answered): the model's,
        else the tokenizer's own size bounds the ids."""
        if isinstance(message, UnparsedRequest):
            return await self._pool.run(len(message.raw), self._text_of_unparsed, message, vocab_size)
        text = self._check_detokenize(message, vocab_size)
        ids = message.token_ids
        skip = message.skip_special_tokens
        if len(ids) <= INLINE_TOKEN_IDS:
            return text.decode(ids, skip_special_tokens=skip)
        return await self._pool.run(len(ids), text.decode, list(ids), skip)

    def _generate_unparsed(self, request: UnparsedRequest, info: executor_pb2.ExecutorInfo) -> Request:
        """generate_request's work on a pool thread, parsing first."""
        parsed = parse_request(request, min(self.limits.max_prompt_tokens, info.max_model_len))
        message = parsed.message
        assert isinstance(message, pb.GenerateRequest)
        # Refuses a list left undecoded: it holds more ids than allowed.
        check_generate(message, self.limits, info.max_model_len, parsed.undecoded_ids)
        refuse_certain_overflow(message, self.text, info.max_model_len)
        return build_request(message, self.text, info, self.defaults)

    def _token_ids_unparsed(self, request: UnparsedRequest, most: int) -> list[int]:
        message = parse_request(request, most).message
        assert isinstance(message, pb.TokenizeRequest)
        check_prompt(message, "input", self.limits, most)
        return prompt_token_ids(message, self.text, "input")

    def _text_of_unparsed(self, request: UnparsedRequest, vocab_size: int | None) -> str:
        parsed = parse_request(request, self.limits.max_prompt_tokens)
        message = parsed.message
        assert isinstance(message, pb.DetokenizeRequest)
        # Refuses a list left undecoded: it holds more ids than allowed.
        text = self._check_detokenize(message, vocab_size, parsed.undecoded_ids)
        return text.decode(list(message.token_ids), skip_special_tokens=message.skip_special_tokens)

    def _check_detokenize(
        self, message: pb.DetokenizeRequest, vocab_size: int | None, undecoded_ids: int | None = None
    ) -> TextProcessor:
        """The tokenizer to detokenize with; RequestRejected naming what is wrong."""
        text = self.text
        if text is None:
            raise RequestRejected(
                ErrorKind.UNSUPPORTED, "this server has no tokenizer (start it with --tokenizer) to detokenize with"
            )
        ids = message.token_ids
        count = len(ids) if undecoded_ids is None else undecoded_ids
        if count > self.limits.max_prompt_tokens:
            raise RequestRejected(
                ErrorKind.INVALID,
                f"{count} token ids; at most {self.limits.max_prompt_tokens} are allowed (--max-prompt-tokens)",
            )
        # Ids past the tokenizer's own table have no text, whatever the model's vocabulary holds.
        bound = min(vocab_size, len(text.tokenizer)) if vocab_size else len(text.tokenizer)
        outside = sorted({t for t in ids if t >= bound})
        if outside:
            raise RequestRejected(
                ErrorKind.INVALID, f"token ids {outside[:10]} are outside the vocabulary of {bound}"
            )
        return text

    def close(self) -> None:
        self._pool.close()


def prompt_size(message: pb.GenerateRequest | pb.TokenizeRequest, field: str) -> int:
    """What orders the request in the tokenizer pool: characters of text or chat contents, or
    token ids (checking and hashing an id costs a quarter of tokenizing a character, so an id
    prompt never ranks ahead of work it outlasts). A chat's tools and tool calls are text it
    renders."""
    kind = message.WhichOneof(field)
    if kind == "text":
        return len(message.text)
    if kind == "chat":
        return sum(map(len, chat_texts(message.chat)))
    return 0 if kind is None else len(message.token_ids.ids)


def _is_inline(message: pb.GenerateRequest | pb.TokenizeRequest, field: str, size: int) -> bool:
    return size <= (INLINE_TOKEN_IDS if message.WhichOneof(field) == "token_ids" else INLINE_TEXT_CHARS)


def refuse_certain_overflow(message: pb.GenerateRequest, text: TextProcessor | None, max_model_len: int) -> None:
    """The engine's refusal of a prompt that leaves no room under the model's length, made
    before tokenizing where the text's length alone proves it (text/token_count_bound.py)."""
    if text is None or message.WhichOneof("prompt") != "text":
        return
    fewest = text.fewest_tokens(message.text)
    if fewest >= max_model_len:
        raise RequestRejected(
            ErrorKind.INVALID,
            f"prompt of at least {fewest} tokens leaves no room to generate under the maximum "
            f"model length of {max_model_len}",
        )


def sampling_from_proto(message: pb.SamplingParams, defaults: SamplingDefaults) -> SamplingParams:
    """A field the request leaves unset takes its default."""

    def optional(name: str, default: float | int | None) -> float | int | None:
        return getattr(message, name) if message.HasField(name) else default

    return SamplingParams(
        max_tokens=optional("max_tokens", defaults.max_tokens),
        min_tokens=message.min_tokens,
        temperature=optional("temperature", defaults.temperature),
        top_k=optional("top_k", defaults.top_k),
        top_p=optional("top_p", defaults.top_p),
        min_p=optional("min_p", defaults.min_p),
        seed=optional("seed", None),
        repetition_penalty=optional("repetition_penalty", defaults.repetition_penalty),
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=optional("logprobs", None),
        skip_special_tokens=not message.keep_special_tokens,
        include_stop_str_in_output=message.include_stop_str_in_output,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        allowed_token_ids=tuple(message.allowed_token_ids),
        structured_output=spec_from_proto(message),
        prompt_logprobs=optional("prompt_logprobs", None),
        n=optional("n", 1),
        best_of=optional("best_of", None),
    )


def prompt_token_ids(
    message: pb.GenerateRequest | pb.TokenizeRequest, text: TextProcessor | None, field: str
) -> list[int]:
    """Token ids of the request's prompt (field names the oneof: 'prompt' or 'input')."""
    kind = message.WhichOneof(field)
    if kind is None:
        raise RequestRejected(ErrorKind.INVALID, "no prompt: set one of text, token_ids or chat")
    if kind == "token_ids":
        return list(message.token_ids.ids)
    if text is None:
        raise RequestRejected(
            ErrorKind.UNSUPPORTED,
            f"this server has no tokenizer (start it with --tokenizer); send token_ids instead of {kind}",
        )
    if kind == "text":
        return text.encode(message.text)
    if not text.has_chat_template:
        raise RequestRejected(ErrorKind.UNSUPPORTED, "the tokenizer has no chat template; send text")
    if not message.chat.messages:
        raise RequestRejected(ErrorKind.INVALID, "chat has no messages")
    chat = chat_input(message.chat)
    variables = {name: template_value(value) for name, value in message.chat.template_kwargs.items()}
    if None in variables.values():
        unset = sorted(name for name, value in variables.items() if value is None)
        raise RequestRejected(ErrorKind.INVALID, f"chat template_kwargs {unset[:10]} have no value set")
    try:
        return text.encode_chat(chat.turns, message.chat.add_generation_prompt, variables, chat.tools)
    except (ValueError, TemplateError) as error:
        # The template refused the conversation (its raise_exception: roles out of order, say)
        # or its content cannot be kept apart from the template's control tokens.
        raise RequestRejected(ErrorKind.INVALID, f"the chat cannot be rendered: {error}") from None


def template_value(value: pb.TemplateValue) -> TemplateValue | None:
    kind = value.WhichOneof("kind")
    return None if kind is None else getattr(value, kind)


def context_overflow(prompt_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    """vLLM's refusal of a request that asks for more tokens than the context holds, or None.

    A prompt that alone fills the context is the engine's to refuse ("leaves no room").
    """
    if prompt_tokens >= max_model_len or prompt_tokens + max_tokens <= max_model_len:
        return None
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
        "completion). Please reduce the length of the messages or completion."
    )


def build_request(
    message: pb.GenerateRequest,
    text: TextProcessor | None,
    info: executor_pb2.ExecutorInfo,
    defaults: SamplingDefaults,
) -> Request:
    """The scheduler's request, its prefix blocks hashed for the executors' block size."""
    vocab_size, max_logprobs = info.vocab_size, info.max_logprobs
    token_ids = prompt_token_ids(message, text, "prompt")
    if not token_ids:
        raise RequestRejected(ErrorKind.INVALID, "the prompt is empty")
    outside = sorted({t for t in token_ids if t >= vocab_size})
    if outside:
        raise RequestRejected(
            ErrorKind.INVALID,
            f"prompt token ids {outside[:10]} are outside the vocabulary of {vocab_size}",
        )
    sampling = sampling_from_proto(message.sampling, defaults)
    problems = sampling.problems(vocab_size, max_logprobs)
    # Only a max_tokens the caller asked for: the server's default is capped by the context.
    if message.sampling.HasField("max_tokens") and sampling.max_tokens:
        overflow = context_overflow(len(token_ids), sampling.max_tokens, info.max_model_len)
        if overflow is not None:
            problems.append(overflow)
    if sampling.stop and text is None:
        problems.append("stop strings need a tokenizer (start the server with --tokenizer)")
    if problems:
        raise RequestRejected(ErrorKind.INVALID, "; ".join(problems))
    request = Request(
        request_id=message.request_id or uuid.uuid4().hex,
        prompt_token_ids=token_ids,
        sampling=sampling,
        priority=message.priority,
        cache_salt=message.cache_salt.encode(),
        ttft_deadline_s=message.ttft_deadline_ms / 1000,
        tpot_target_s=message.tpot_target_ms / 1000,
    )
    # Hashed here, off the event loop for a big prompt; the planner extends these as the
    # request grows (Scheduler.prefix_hashes).
    request.prefix_hashes = prefix_hashes(token_ids, info.block_size, request.cache_salt)
    request.prefix_hashes_block_size = info.block_size
    return request
