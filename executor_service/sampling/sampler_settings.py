"""What the sampler needs of a request (the executor's share of its sampling settings), read
from the proto with its 'zero means off' defaults."""

from __future__ import annotations

from dataclasses import dataclass

from protos.sampling_ranges import (
    SAMPLING_RANGES,
    logit_bias_problem,
    range_problems,
    vocab_problem,
)
from protos.splitserve.executor.v1 import executor_pb2

# Below this a temperature is greedy, as in vLLM: dividing logits by a denormal such as 1e-38
# overflows them to inf, and the softmax of infs is NaN.
SAMPLING_EPS = 1e-5


@dataclass(slots=True, frozen=True)
class SamplerSettings:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_logprobs: int = 0
    want_logprobs: bool = False
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    # (token id, bias) pairs added to the logits, and the only tokens that may be sampled (empty:
    # any).
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    # Score the prompt's tokens, with this many alternatives each.
    want_prompt_logprobs: bool = False
    num_prompt_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def shapes_logits(self) -> bool:
        """Whether its logits are biased or restricted before the sampler reads them."""
        return bool(self.logit_bias or self.allowed_token_ids)

    @classmethod
    def from_proto(cls, config: executor_pb2.SamplerConfig) -> SamplerSettings:
        return cls(
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p or 1.0,
            min_p=config.min_p,
            seed=config.seed if config.has_seed else None,
            repetition_penalty=config.repetition_penalty or 1.0,
            presence_penalty=config.presence_penalty,
            frequency_penalty=config.frequency_penalty,
            num_logprobs=config.num_logprobs,
            want_logprobs=config.want_logprobs,
            min_tokens=config.min_tokens,
            min_tokens_stop_ids=tuple(config.min_tokens_stop_ids),
            # check_new refuses lists of unequal lengths.
            logit_bias=tuple(zip(config.logit_bias_token_ids, config.logit_bias_values)),
            allowed_token_ids=tuple(config.allowed_token_ids),
            want_prompt_logprobs=config.want_prompt_logprobs,
            num_prompt_logprobs=config.num_prompt_logprobs,
        )


def sampling_problem(settings: SamplerSettings, max_logprobs: int, vocab_size: int) -> str | None:
    """What is wrong with a request's sampling settings (parsed from its SamplerConfig once, by
    SamplerSettings.from_proto), or None when they are usable."""
    bad_stop_ids = [t for t in settings.min_tokens_stop_ids if t >= vocab_size]
    if bad_stop_ids:
        return (
            f"sampling.min_tokens_stop_ids holds {bad_stop_ids[0]}, outside the vocab "
            f"[0, {vocab_size})"
        )
    shaping_problem = logit_bias_problem(settings.logit_bias, vocab_size, "sampling.logit_bias")
    shaping_problem = shaping_problem or vocab_problem(settings.allowed_token_ids, vocab_size, "sampling.allowed_token_ids")
    if shaping_problem is not None:
        return shaping_problem
    if settings.num_logprobs > max_logprobs:
        return f"sampling.num_logprobs must be <= {max_logprobs}, got {settings.num_logprobs}"
    if settings.num_prompt_logprobs > max_logprobs:
        return f"sampling.num_prompt_logprobs must be <= {max_logprobs}, got {settings.num_prompt_logprobs}"
    # Checked as the sampler will use them: the proto's zero defaults mean "off".
    problems = range_problems(
        {name: getattr(settings, name) for name in SAMPLING_RANGES}, prefix="sampling."
    )
    return problems[0] if problems else None
