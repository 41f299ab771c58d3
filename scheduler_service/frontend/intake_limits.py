"""Caps on what one client request may carry, checked on the parsed message (a token-id list
too long to be allowed is counted, not decoded) before any tokenizing, hashing or copying, so an
oversized request costs its sender, not the server; and how many requests are tokenized at once.

Each cap is a flag (scheduler_service/__main__.py). The receive limit is derived from them: a
message larger than any request the caps allow is refused from its length alone, before it is
parsed (frontend/message_parsing.py), with INVALID_ARGUMENT naming its largest field. gRPC's
own limit sits above that, at --max-message-bytes, as a ceiling on what is buffered at all:
gRPC answers RESOURCE_EXHAUSTED there with no way to say which cap was broken. By default it is
twice the receive limit: gRPC buffers every message whole (and copies it) before anyone can
judge it, so the ceiling times the streams a client opens is memory the client can make the
process take. At a 64 MiB ceiling, 20 messages of 64 MiB sent at once took a scheduler from
86 MiB to 1.3 GiB resident, and 30 would take a front-end past its pod's 2 GiB limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.text.tokenizer_pool import default_threads

# Printable ASCII without spaces: safe in key=value log lines and in any HTTP header.
REQUEST_ID_PATTERN = re.compile(r"[!-~]+")
# Worst-case bytes of one token id on the wire (a uint32 varint).
TOKEN_ID_WIRE_BYTES = 5
# Field tags, lengths and the sampling message: generous room beside the capped fields.
ENVELOPE_BYTES = 64 << 10
# Framing of one chat message beside its content (tags, lengths, a role name); of one tool or
# tool call beside its strings alike.
CHAT_MESSAGE_OVERHEAD_BYTES = 64
# Tools a chat may offer, and tool calls its turns may hold together: far above what a model's
# prompt holds usefully (OpenAI allows 128 tools), and what bounds their framing on the wire.
MAX_TOOLS = 128
MAX_TOOL_CALLS = 512
# gRPC's default ceiling on one message, in multiples of the largest request the caps allow: a
# request up to this far over its caps still hears which field broke them (as TGI's 2 MB
# --payload-limit, the default scales with the caps, so raising a cap raises it too).
TRANSPORT_HEADROOM = 2


@dataclass(slots=True, frozen=True)
class IntakeLimits:
    # UTF-8 bytes of a text prompt, or of all chat contents together.
    max_prompt_bytes: int = 1 << 20
    # Token ids of a token-id prompt (also capped by the model's maximum length).
    max_prompt_tokens: int = 262_144
    max_request_id_chars: int = 128
    max_cache_salt_bytes: int = 256
    max_stop_strings: int = 16
    max_stop_bytes: int = 1024
    max_stop_token_ids: int = 256
    max_chat_messages: int = 512
    # Choices one request may ask for (SamplingParams.n and best_of): each is a sequence with
    # K/V of its own beyond the shared prompt.
    max_choices: int = 16
    # Bytes gRPC takes in for one message before it refuses it (RESOURCE_EXHAUSTED) unread;
    # None: TRANSPORT_HEADROOM times what the caps allow (receive_limit_bytes).
    max_message_bytes: int | None = None
    # Roles a chat message may have; the chat template renders any string it is given, so
    # an unknown role would be written into the prompt verbatim.
    chat_roles: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})
    # Threads tokenizing requests at once (text/tokenizer_pool.py keeps one for small prompts).
    tokenizer_threads: int = field(default_factory=default_threads)

    def receive_limit_bytes(self) -> int:
        """The largest GenerateRequest these caps allow, with room for its framing."""
        prompt = max(
            self.max_prompt_bytes
            + (self.max_chat_messages + MAX_TOOLS + MAX_TOOL_CALLS) * CHAT_MESSAGE_OVERHEAD_BYTES,
            self.max_prompt_tokens * TOKEN_ID_WIRE_BYTES,
        )
        stops = self.max_stop_strings * (self.max_stop_bytes + 8) + self.max_stop_token_ids * TOKEN_ID_WIRE_BYTES
        return ENVELOPE_BYTES + prompt + stops + self.max_request_id_chars + self.max_cache_salt_bytes

    def transport_limit_bytes(self) -> int:
        """gRPC's receive limit: the ceiling, but never below what the caps allow."""
        if self.max_message_bytes is None:
            return TRANSPORT_HEADROOM * self.receive_limit_bytes()
        return max(self.max_message_bytes, self.receive_limit_bytes())


def check_generate(
    message: pb.GenerateRequest, limits: IntakeLimits, max_model_len: int, undecoded_ids: int | None = None
) -> None:
    """RequestRejected (INVALID) naming the first cap the request breaks. undecoded_ids: the
    prompt is a token-id list of this many ids, left undecoded (frontend/request_parsing.py)."""
    _check_request_id(message.request_id, limits)
    if _utf8_length_exceeds(message.cache_salt, limits.max_cache_salt_bytes):
        _reject(f"cache_salt is longer than {limits.max_cache_salt_bytes} bytes")
    stops = message.sampling.stop
    if len(stops) > limits.max_stop_strings:
        _reject(f"{len(stops)} stop strings; at most {limits.max_stop_strings} are allowed")
    stop_ids = message.sampling.stop_token_ids
    if len(stop_ids) > limits.max_stop_token_ids:
        _reject(f"{len(stop_ids)} stop token ids; at most {limits.max_stop_token_ids} are allowed")
    choices = max(message.sampling.n, message.sampling.best_of)
    if choices > limits.max_choices:
        _reject(f"{choices} choices (n, best_of); at most {limits.max_choices} are allowed (--max-choices)")
    for stop in stops:
        if not stop:
            _reject("a stop string is empty")
        if _utf8_length_exceeds(stop, limits.max_stop_bytes):
            _reject(f"a stop string is longer than {limits.max_stop_bytes} bytes")
    check_prompt(message, "prompt", limits, max_model_len, undecoded_ids)


def check_prompt(
    message: pb.GenerateRequest | pb.TokenizeRequest,
    field: str,
    limits: IntakeLimits,
    max_model_len: int,
    undecoded_ids: int | None = None,
) -> None:
    """The prompt's caps (field names the oneof: 'prompt' or 'input')."""
    kind = "token_ids" if undecoded_ids is not None else message.WhichOneof(field)
    if kind == "text":
        if _utf8_length_exceeds(message.text, limits.max_prompt_bytes):
            _reject(f"the prompt text is longer than {limits.max_prompt_bytes} bytes (--max-prompt-bytes)")
    elif kind == "token_ids":
        count = len(message.token_ids.ids) if undecoded_ids is None else undecoded_ids
        most = min(limits.max_prompt_tokens, max_model_len)
        if count > most:
            _reject(
                f"the prompt has {count} token ids; at most {most} are allowed (the smaller of "
                f"--max-prompt-tokens and the maximum model length of {max_model_len})"
            )
    elif kind == "chat":
        _check_chat(message.chat, limits)


def chat_texts(chat: pb.Chat) -> Iterator[str]:
    """Every string of a chat that reaches the prompt: contents, tools, tool calls and results."""
    for tool in chat.tools:
        yield from (tool.name, tool.description, tool.parameters)
    for turn in chat.messages:
        yield from (turn.content, turn.tool_call_id, turn.name)
        for call in turn.tool_calls:
            yield from (call.id, call.name, call.arguments)


def _check_chat(chat: pb.Chat, limits: IntakeLimits) -> None:
    if len(chat.messages) > limits.max_chat_messages:
        _reject(f"the chat has {len(chat.messages)} messages; at most {limits.max_chat_messages} are allowed")
    if len(chat.tools) > MAX_TOOLS:
        _reject(f"the chat has {len(chat.tools)} tools; at most {MAX_TOOLS} are allowed")
    calls = sum(len(turn.tool_calls) for turn in chat.messages)
    if calls > MAX_TOOL_CALLS:
        _reject(f"the chat's messages hold {calls} tool calls; at most {MAX_TOOL_CALLS} are allowed")
    for index, turn in enumerate(chat.messages):
        if turn.role not in limits.chat_roles:
            shown = turn.role if len(turn.role) <= 32 else turn.role[:32] + "..."
            _reject(
                f"chat message {index} has role {shown!r}; the roles allowed are "
                f"{', '.join(sorted(limits.chat_roles))} (--chat-roles)"
            )
    budget = limits.max_prompt_bytes
    for text in chat_texts(chat):
        if _utf8_length_exceeds(text, budget):
            _reject(
                f"the chat's contents, tools and tool calls are longer than {limits.max_prompt_bytes} "
                "bytes together (--max-prompt-bytes)"
            )
        budget -= len(text.encode())


def _check_request_id(request_id: str, limits: IntakeLimits) -> None:
    if not request_id:
        return
    if len(request_id) > limits.max_request_id_chars:
        _reject(f"request_id is longer than {limits.max_request_id_chars} characters")
    if REQUEST_ID_PATTERN.fullmatch(request_id) is None:
        _reject("request_id may hold only printable ASCII characters without spaces")


def _utf8_length_exceeds(text: str, limit: int) -> bool:
    # A character takes 1 to 4 bytes: most texts are judged by length alone, without encoding.
    if len(text) > limit:
        return True
    if 4 * len(text) <= limit:
        return False
    return len(text.encode()) > limit


def _reject(message: str) -> None:
    raise RequestRejected(ErrorKind.INVALID, message)
