"""vLLM's refusal of a prompt plus max_tokens beyond the model's maximum length, at its bounds.
(Through real processes, both APIs: tests/clients/test_openai_gateway.py.)"""

from __future__ import annotations

from scheduler_service.frontend.request_intake import context_overflow


def test_a_request_that_fits_the_context_exactly_is_taken() -> None:
    assert context_overflow(prompt_tokens=100, max_tokens=156, max_model_len=256) is None


def test_one_token_more_is_refused_with_vllms_numbers() -> None:
    assert context_overflow(prompt_tokens=100, max_tokens=157, max_model_len=256) == (
        "This model's maximum context length is 256 tokens. However, you requested 257 tokens "
        "(100 in the messages, 157 in the completion). Please reduce the length of the messages or "
        "completion."
    )


def test_a_prompt_that_alone_fills_the_context_is_left_to_the_engines_refusal() -> None:
    assert context_overflow(prompt_tokens=256, max_tokens=4, max_model_len=256) is None
