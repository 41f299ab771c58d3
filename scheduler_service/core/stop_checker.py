"""Whether a request is done after its latest token (stop strings are the detokenizer's job)."""

from collections.abc import Container

from scheduler_service.core.request import FinishReason, Request


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
    if sampling.max_tokens is not None and request.num_output_tokens >= sampling.max_tokens:
        return FinishReason.LENGTH, None
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None


def may_sample_more(request: Request, max_model_len: int) -> bool:
    """False once the tokens already sampled (or in flight) reach a length limit, so no step is
    spent on a token that would be thrown away."""
    expected = request.num_tokens + request.num_pending_outputs
    if expected >= max_model_len:
        return False
    max_tokens = request.sampling.max_tokens
    return max_tokens is None or expected - request.num_prompt_tokens < max_tokens
