"""The peer comparison's workloads: token-id prompts and per-request output lengths, the same for
every system, drawn from a seed (ids 0-2 are left out: special tokens in both models).

- fixed: prompts uniform in [min_prompt, max_prompt] tokens, new_tokens each;
- varied: the same prompts, new tokens uniform in [min_new_tokens, max_new_tokens] per request;
- shared-prefix: shared_requests prompts of one shared_prefix-token system prompt followed by a
  distinct shared_tail-token tail, shared_new_tokens each.

Each has a warm-up (warm_up_of): the same shapes with other token ids, which every system runs
untimed before its timed run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.peer_io import PeerRequest

WORKLOADS = ("fixed", "varied", "shared-prefix")
FIRST_ORDINARY_ID = 3


@dataclass(slots=True, frozen=True)
class WorkloadSizes:
    requests: int = 32
    min_prompt: int = 32
    max_prompt: int = 512
    new_tokens: int = 128
    min_new_tokens: int = 16
    max_new_tokens: int = 256
    shared_requests: int = 64
    shared_prefix: int = 384
    shared_tail: int = 32
    shared_new_tokens: int = 128
    seed: int = 0


@dataclass(slots=True, frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    new_tokens: list[int]

    @property
    def requests(self) -> list[PeerRequest]:
        return [PeerRequest(p, n) for p, n in zip(self.prompts, self.new_tokens, strict=True)]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.new_tokens)

    @property
    def longest(self) -> int:
        """Prompt plus output tokens of the longest request."""
        return max(len(p) + n for p, n in zip(self.prompts, self.new_tokens, strict=True))


def random_ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(count)]


def varied_length_prompts(sizes: WorkloadSizes, vocab: int) -> list[list[int]]:
    rng = random.Random(f"prompts:{sizes.seed}")
    return [random_ids(rng, rng.randint(sizes.min_prompt, sizes.max_prompt), vocab) for _ in range(sizes.requests)]


def build_workload(name: str, sizes: WorkloadSizes, vocab: int) -> Workload:
    if name == "fixed":
        return Workload(
            name,
            f"{sizes.requests} requests, prompts {sizes.min_prompt}-{sizes.max_prompt} tokens, "
            f"{sizes.new_tokens} new tokens each",
            varied_length_prompts(sizes, vocab),
            [sizes.new_tokens] * sizes.requests,
        )
    if name == "varied":
        rng = random.Random(f"new-tokens:{sizes.seed}")
        return Workload(
            name,
            f"{sizes.requests} requests, prompts {sizes.min_prompt}-{sizes.max_prompt} tokens, "
            f"{sizes.min_new_tokens}-{sizes.max_new_tokens} new tokens",
            varied_length_prompts(sizes, vocab),
            [rng.randint(sizes.min_new_tokens, sizes.max_new_tokens) for _ in range(sizes.requests)],
        )
    if name == "shared-prefix":
        rng = random.Random(f"shared-prefix:{sizes.seed}")
        prefix = random_ids(rng, sizes.shared_prefix, vocab)
        return Workload(
            name,
            f"{sizes.shared_requests} requests, one {sizes.shared_prefix}-token system prompt + "
            f"distinct {sizes.shared_tail}-token tails, {sizes.shared_new_tokens} new tokens each",
            [prefix + random_ids(rng, sizes.shared_tail, vocab) for _ in range(sizes.shared_requests)],
            [sizes.shared_new_tokens] * sizes.shared_requests,
        )
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def warm_up_of(workload: Workload, vocab: int) -> Workload:
    """The untimed run every system gets before the timed one, in the same process: the workload's
    shapes (every prompt's length, every request's output tokens, the prompts' shared prefixes)
    with each id moved half the ordinary range along, so it warms up every batch shape, compiled
    graph and allocation the timed run will meet but leaves nothing in a prefix cache that the
    timed prompts could reuse."""
    span = vocab - FIRST_ORDINARY_ID
    shift = span // 2

    def moved(ids: list[int]) -> list[int]:
        return [FIRST_ORDINARY_ID + (token - FIRST_ORDINARY_ID + shift) % span for token in ids]

    return Workload(
        f"{workload.name} warm-up",
        f"{workload.description}, other token ids",
        [moved(prompt) for prompt in workload.prompts],
        list(workload.new_tokens),
    )
