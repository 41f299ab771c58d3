"""The throughput benchmark's inputs and per-system results: plain records shared by both runs."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

# The roles whose CPU over a timed run SystemResult.cpu_s reports: splitserve's services'
# processes, and the benchmark's own, whose client streams every request.
EXECUTOR_ROLE, SCHEDULER_ROLE, CLIENT_ROLE = "executor", "scheduler", "client"


@dataclass(slots=True, frozen=True)
class BenchConfig:
    requests: int = 32
    new_tokens: int = 128
    min_prompt: int = 32
    max_prompt: int = 512
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    # The random Llama fixes the MLP width (1408, not the usual 4x hidden).
    intermediate: int = 1408
    vocab: int = 32000
    threads: int = 2
    # splitserve's executors, sharing the threads (2 executors of 1 thread each on 2 cores).
    executors: int = 1
    seed: int = 0
    # The scheduler's default step budget; longer prefills are chunked, as in production.
    max_num_batched_tokens: int = 2048
    block_size: int = 16

    @property
    def max_model_len(self) -> int:
        return self.max_prompt + self.new_tokens

    @property
    def num_kv_blocks(self) -> int:
        # Room for every request at its longest at once, so no preemption muddies the comparison
        # (the static-batch peer never recomputes either).
        per_request = -(-self.max_model_len // self.block_size)
        return self.requests * per_request + 16


def make_prompts(config: BenchConfig) -> list[list[int]]:
    """Random prompts with lengths uniform in [min_prompt, max_prompt]; ids skip 0-2 (special)."""
    rng = random.Random(config.seed)
    return [
        [rng.randrange(3, config.vocab) for _ in range(rng.randint(config.min_prompt, config.max_prompt))]
        for _ in range(config.requests)
    ]


@dataclass(slots=True, frozen=True)
class SystemResult:
    system: str
    wall_s: float
    output_tokens: int
    # Seconds from the first send to each request's first output token.
    ttft_s: list[float]
    outputs: list[list[int]]
    # Per request, seconds from the first send to the arrival of each output token (where known).
    token_times_s: list[list[float]] = field(default_factory=list)
    # Prompt tokens served from a prefix cache instead of being computed.
    cached_prompt_tokens: int = 0
    # CPU seconds over the timed run by role (throughput_splitserve.drive's cpu_roles and the
    # client); empty where not measured.
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def ttft_p50_s(self) -> float:
        return statistics.median(self.ttft_s)
