"""Turns a client's GenerateRequest into a scheduler Request, or says exactly what is wrong."""

import uuid

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.text.tokenizer import TextProcessor


def sampling_from_proto(message: pb.SamplingParams) -> SamplingParams:
    def optional(name: str, default: float | int | None) -> float | int | None:
        return getattr(message, name) if message.HasField(name) else default

    return SamplingParams(
        max_tokens=optional("max_tokens", None),
        min_tokens=message.min_tokens,
        temperature=optional("temperature", 1.0),
        top_k=message.top_k,
        top_p=optional("top_p", 1.0),
        min_p=message.min_p,
        seed=optional("seed", None),
        repetition_penalty=optional("repetition_penalty", 1.0),
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=optional("logprobs", None),
        skip_special_tokens=not message.keep_special_tokens,
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
    turns = [(m.role, m.content) for m in message.chat.messages]
    if not turns:
        raise RequestRejected(ErrorKind.INVALID, "chat has no messages")
    return text.encode_chat(turns, add_generation_prompt=message.chat.add_generation_prompt)


def build_request(
    message: pb.GenerateRequest,
    text: TextProcessor | None,
    vocab_size: int,
    max_logprobs: int,
) -> Request:
    token_ids = prompt_token_ids(message, text, "prompt")
    if not token_ids:
        raise RequestRejected(ErrorKind.INVALID, "the prompt is empty")
    outside = sorted({t for t in token_ids if t >= vocab_size})
    if outside:
        raise RequestRejected(
            ErrorKind.INVALID,
            f"prompt token ids {outside[:10]} are outside the vocabulary of {vocab_size}",
        )
    sampling = sampling_from_proto(message.sampling)
    problems = sampling.problems(vocab_size, max_logprobs)
    if sampling.stop and text is None:
        problems.append("stop strings need a tokenizer (start the server with --tokenizer)")
    if problems:
        raise RequestRejected(ErrorKind.INVALID, "; ".join(problems))
    return Request(
        request_id=message.request_id or uuid.uuid4().hex,
        prompt_token_ids=token_ids,
        sampling=sampling,
        priority=message.priority,
        cache_salt=message.cache_salt.encode(),
    )
