"""Sampling and stop settings of one request, validated once at arrival."""

from dataclasses import dataclass

from protos.sampling_ranges import (
    SAMPLING_RANGES,
    logit_bias_problem,
    range_problems,
    vocab_problem,
)
from scheduler_service.core.structured_output import StructuredOutput


@dataclass(slots=True, frozen=True)
class SamplingDefaults:
    """What a request gets for each sampling field it leaves unset: the model's
    generation_config.json where it sets one (text/generation_config.py), else these."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    # Where the values come from, for ModelInfo and the start-up log.
    source: str = "built-in"

    def problems(self) -> list[str]:
        """Every value a request could not have, as a sentence."""
        params = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )
        return params.problems(vocab_size=0, max_logprobs=0)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # The stop string that ended the request ends the output text too (vLLM's field).
    include_stop_str_in_output: bool = False
    # (token id, bias) pairs added to the logits, ids ascending; the only ids that may be
    # generated (empty: any).
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    # The grammar the output follows (structured outputs); None: unconstrained.
    structured_output: StructuredOutput | None = None
    # Score the prompt: each prompt token's logprob after the first, with this many alternatives.
    prompt_logprobs: int | None = None
    # Choices generated for the prompt, and how many are generated to keep the n most likely
    # (None: n): the front-end forks the request into that many choices (frontend/choices.py),
    # each of which the planner sees as a request of its own with n = 1.
    n: int = 1
    best_of: int | None = None

    @property
    def num_choices(self) -> int:
        """Choices generated (best_of, or n)."""
        return self.best_of or self.n

    def problems(self, vocab_size: int, max_logprobs: int) -> list[str]:
        """Every way these settings are invalid, each as a sentence for the client."""
        found = range_problems({name: getattr(self, name) for name in SAMPLING_RANGES})
        if self.max_tokens is not None and self.max_tokens < 1 and not (self.max_tokens == 0 and self.prompt_logprobs is not None):
            found.append(f"max_tokens must be at least 1 (0 only with prompt_logprobs), got {self.max_tokens}")
        if self.n < 1:
            found.append(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            found.append(f"best_of must be at least n ({self.n}), got {self.best_of}")
        if self.num_choices > 1 and self.max_tokens == 0:
            found.append("n and best_of above 1 cannot be combined with max_tokens 0 (the prompt is scored once)")
        if self.top_k < 0:
            found.append(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and self.logprobs > max_logprobs:
            found.append(f"logprobs must be at most {max_logprobs}, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            found.append(f"prompt_logprobs must be at most {max_logprobs}, got {self.prompt_logprobs}")
        bad_ids = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad_ids:
            found.append(f"stop_token_ids {bad_ids} are outside the vocabulary of {vocab_size}")
        if any(not s for s in self.stop):
            found.append("stop strings must not be empty")
        bias_problem = logit_bias_problem(self.logit_bias, vocab_size, "logit_bias")
        if bias_problem is not None:
            found.append(bias_problem)
        allowed_problem = vocab_problem(self.allowed_token_ids, vocab_size, "allowed_token_ids")
        if allowed_problem is not None:
            found.append(allowed_problem)
        if self.structured_output is not None:
            found.extend(self.structured_output.problems())
            # The grammar ends the output with end-of-sequence where its sentence is complete:
            # neither may forbid that end.
            if self.ignore_eos:
                found.append("ignore_eos cannot be combined with structured_output")
            if self.min_tokens:
                found.append("min_tokens cannot be combined with structured_output")
            # Their intersection could be empty, and then no token could be sampled at all.
            if self.allowed_token_ids:
                found.append("allowed_token_ids cannot be combined with structured_output (the grammar decides)")
        return found
