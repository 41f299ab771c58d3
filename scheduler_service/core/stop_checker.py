"""Whether a request is done after its latest token (stop strings are the detokenizer's job).

The rules for one request at a time live here; DecodeSet.apply applies the same two (length_limit
and the EOS ids) to steady decodes in bulk, which have no stop token ids and no min_tokens."""

from collections.abc import Container

from scheduler_service.core.request import FinishReason, Request


def length_limit(request: Request, max_model_len: int) -> int:
    """Tokens (prompt and output) at which the request stops for length."""
    max_tokens = request.sampling.max_tokens
    return max_model_len if max_tokens is None else min(max_model_len, request.num_prompt_tokens + max_tokens)


def stop_reason_of_bulk_decode(request: Request, token: int, eos_token_ids: Container[int]) -> FinishReason:
    """Why a steady decode that DecodeSet found stopped on `token`: its EOS, else its length."""
    return FinishReason.STOP if not request.sampling.ignore_eos and token in eos_token_ids else FinishReason.LENGTH


def check_stop(
    request: Request, eos_token_ids: Container[int], max_model_len: int
) -> tuple[FinishReason, str | None] | None:
    """The reason to stop and the stop token that caused it, or None to go on."""
    sampling = request.sampling
    last = request.token_ids[-1]
    if request.num_output_tokens >= sampling.min_tokens:
        if not sampling.ignore_eos and last in eos_token_ids:
            return FinishReason.STOP, None
        if last in sampling.stop_token_ids:
            return FinishReason.STOP, str(last)
    if request.num_tokens >= length_limit(request, max_model_len):
        return FinishReason.LENGTH, None
    return None


def may_sample_more(request: Request, max_model_len: int) -> bool:
    """False once the tokens already sampled (or in flight) reach a length limit, so no step is
    spent on a token that would be thrown away."""
    return request.num_tokens + request.num_pending_outputs < length_limit(request, max_model_len)
