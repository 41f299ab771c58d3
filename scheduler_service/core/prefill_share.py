"""What a mixed step leaves for prefill beside its decodes under a step token limit (the lane's
--target-itl-ms, as its step timer reads it): the scheduler plans by it, and deadline admission's
forecasts (ttft_forecast.py, queue_forecast.py) count prompts' steps by it."""

# Prefill tokens a step that carries decodes gets under a step token limit, however tight: a
# long prompt still advances while a large decode batch alone fills the limit.
MIN_PREFILL_TOKENS = 32


def prefill_within(room: int, decoding: int, step_token_limit: int | None) -> int:
    """The prefill tokens a step may compute beside `decoding` decode tokens, `room` being what
    --max-num-batched-tokens leaves them: no more than the limit leaves, but at least
    MIN_PREFILL_TOKENS. A step without a limit, or without decodes, is not limited."""
    if step_token_limit is None or not decoding:
        return room
    return min(room, max(step_token_limit - decoding, MIN_PREFILL_TOKENS))
