"""What the client returns: plain records built from the server's messages."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import grpc

from clients.errors import SplitserveError
from protos.splitserve.v1 import generation_pb2 as pb

FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True, frozen=True)
class Timings:
    queued_s: float
    time_to_first_token_s: float
    total_s: float
    num_preemptions: int


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    # The tokens' text as UTF-8 bytes (a token may hold part of a character); None, and empty,
    # when the server has no tokenizer.
    token_bytes: bytes | None = None
    top_token_bytes: list[bytes] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class GenerationDelta:
    """One streamed message: the tokens and text that became known since the previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    # 'stop', 'length' or 'abort' on the last delta, None before it.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request (last delta only).
    stop_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    # On the first delta when prompt_logprobs was asked for: one per prompt token after the
    # first, each naming that prompt token.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The choice it belongs to (n > 1), from 0; each choice has its own last delta.
    index: int = 0


@dataclass(slots=True, frozen=True)
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: str | None
    usage: Usage | None
    timings: Timings | None
    # One entry per generated token when logprobs were asked for, else None.
    logprobs: list[TokenLogprob] | None
    # One entry per prompt token after the first when prompt_logprobs was asked for, else None.
    prompt_logprobs: list[TokenLogprob] | None = None
    # Which choice this is (n > 1), from 0.
    index: int = 0
    # With n > 1: every choice, in index order (this result is the first); else empty.
    choices: list["GenerationResult"] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class TokenizeResult:
    token_ids: list[int]
    # Each token's vocabulary piece, in the same order.
    tokens: list[str]


def delta_from_response(response: pb.GenerateResponse) -> GenerationDelta:
    usage = timings = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    if response.HasField("timings"):
        t = response.timings
        timings = Timings(t.queued_s, t.time_to_first_token_s, t.total_s, t.num_preemptions)
    return GenerationDelta(
        request_id=response.request_id,
        token_ids=list(response.token_ids),
        text=response.text,
        logprobs=[_token_logprob(lp) for lp in response.logprobs],
        finish_reason=FINISH_REASONS.get(response.finish_reason),
        stop_reason=response.stop_reason or None,
        usage=usage,
        timings=timings,
        prompt_logprobs=[_token_logprob(lp) for lp in response.prompt_logprobs],
        index=response.index,
    )


def _token_logprob(record: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        record.token_id,
        record.logprob,
        list(record.top_token_ids),
        list(record.top_logprobs),
        record.token_bytes or None,
        list(record.top_token_bytes),
    )


def tokenize_result(response: pb.TokenizeResponse) -> TokenizeResult:
    return TokenizeResult(list(response.token_ids), list(response.tokens))


@dataclass(slots=True)
class _ChoiceParts:
    """What the deltas of one choice brought so far."""

    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    last: GenerationDelta | None = None


@dataclass(slots=True)
class ResultAssembler:
    """Collects a stream's deltas into one GenerationResult (with every choice's, for n > 1)."""

    # Whether the request asked for logprobs (an empty output still has a list then).
    want_logprobs: bool = False
    # Whether it asked for its prompt's logprobs (likewise).
    want_prompt_logprobs: bool = False
    request_id: str = ""
    choices: dict[int, _ChoiceParts] = field(default_factory=dict)

    def add(self, delta: GenerationDelta) -> None:
        self.request_id = delta.request_id or self.request_id
        parts = self.choices.setdefault(delta.index, _ChoiceParts())
        parts.token_ids.extend(delta.token_ids)
        parts.text_parts.append(delta.text)
        parts.logprobs.extend(delta.logprobs)
        parts.prompt_logprobs.extend(delta.prompt_logprobs)
        parts.last = delta

    def result(self) -> GenerationResult:
        if not self.choices:
            raise SplitserveError(grpc.StatusCode.UNKNOWN, "the stream ended without a finish reason")
        results = [self._choice(index) for index in sorted(self.choices)]
        first = results[0]
        if len(results) == 1:
            return first
        # The prompt's scores come with one choice; every choice is the prompt's.
        prompt_logprobs = next((r.prompt_logprobs for r in results if r.prompt_logprobs), first.prompt_logprobs)
        results = [replace(r, prompt_logprobs=prompt_logprobs) for r in results]
        return replace(results[0], choices=results)

    def _choice(self, index: int) -> GenerationResult:
        parts = self.choices[index]
        last = parts.last
        if last is None or last.finish_reason is None:
            # The contract ends every stream (every choice) with a finish reason; anything else
            # is a broken server or connection, not a result.
            raise SplitserveError(
                grpc.StatusCode.UNKNOWN, "the stream ended without a finish reason"
            )
        return GenerationResult(
            request_id=self.request_id,
            token_ids=parts.token_ids,
            text="".join(parts.text_parts),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            usage=last.usage,
            timings=last.timings,
            logprobs=parts.logprobs if self.want_logprobs else None,
            prompt_logprobs=parts.prompt_logprobs if self.want_prompt_logprobs else None,
            index=index,
        )
