"""The continuous-batching peer: transformers' own paged continuous batching (the manager behind
`model.generate_batch`), greedy, EOS disabled, every request with its own max_new_tokens.

`generate_batch` gives every request the same max_new_tokens and starts its manager inside the
call, so this drives the same manager through `continuous_batching_context_manager` and
`add_request` instead: the manager starts (KV cache allocated) outside the timing, as vLLM's
engine and splitserve's services do, and the timing runs from the first request handed over to
the last token. The KV cache holds every request at its longest at once, like splitserve's, and
pages are as long as splitserve's blocks, so prefix sharing (on: allow_block_sharing) has the
same granularity. Prefix hits are counted by wrapping PagedAttentionCache.search_prefix_match,
the one place the manager looks them up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
)
from transformers.generation.continuous_batching import (
    ContinuousBatchingManager,
    PagedAttentionCache,
)
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.continuous_batching.utils import WorkloadHints

from bench.peer_io import ItlKind, PeerRequest, RunResult, token_gaps

logger = logging.getLogger(__name__)

# No token id is -1: the manager's way of saying "no EOS".
NO_EOS = -1
RESULT_POLL_S = 1.0


@dataclass(slots=True)
class PrefixHits:
    tokens: int = 0


@contextmanager
def counting_prefix_hits() -> Iterator[PrefixHits]:
    """Sums the prompt tokens every prefix lookup of the manager's cache matched."""
    hits = PrefixHits()
    original = PagedAttentionCache.search_prefix_match

    def counted(cache: PagedAttentionCache, request_id: str, prompt_ids: list[int]) -> int:
        matched = original(cache, request_id, prompt_ids)
        hits.tokens += matched
        return matched

    PagedAttentionCache.search_prefix_match = counted  # type: ignore[method-assign]
    try:
        yield hits
    finally:
        PagedAttentionCache.search_prefix_match = original  # type: ignore[method-assign]


def collect(manager: ContinuousBatchingManager, request_ids: list[str]) -> dict[str, GenerationOutput]:
    """Waits until every request has finished; raises if one failed or the manager died."""
    pending = set(request_ids)
    results: dict[str, GenerationOutput] = {}
    while pending:
        result = manager.get_result(timeout=RESULT_POLL_S)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"the continuous batching loop stopped with {len(pending)} requests unfinished")
            continue
        if not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        results[result.request_id] = result
        pending.discard(result.request_id)
    return results


def submit(manager: ContinuousBatchingManager, requests: list[PeerRequest], prefix: str) -> list[str]:
    return [
        manager.add_request(
            r.prompt_token_ids,
            request_id=f"{prefix}{index}",
            max_new_tokens=r.max_tokens,
            record_timestamps=True,
            eos_token_id=NO_EOS,
        )
        or ""
        for index, r in enumerate(requests)
    ]


def run_transformers_batch(
    model_dir: Path,
    requests: list[PeerRequest],
    threads: int,
    page_size: int,
    max_batch_tokens: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    warm_up: list[PeerRequest] | None = None,
) -> RunResult:
    """warm_up: requests run the same way first, untimed; without it, two short ones."""
    torch.set_num_threads(threads)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    generation = GenerationConfig(
        max_new_tokens=max(r.max_tokens for r in requests), do_sample=False, eos_token_id=NO_EOS
    )
    batching = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=len(requests) * math.ceil(longest / page_size) + 16,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=len(requests),
        allow_block_sharing=True,
        seed=0,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
        max_generated_length=generation.max_new_tokens,
        num_requests=len(requests),
    )
    with (
        counting_prefix_hits() as hits,
        model.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=batching, workload_hints=hints
        ) as manager,
    ):
        attention = model.config._attn_implementation
        # Warm-up outside the timing; the short default is under a page, so it leaves nothing to
        # share.
        warm = warm_up or [
            PeerRequest(requests[0].prompt_token_ids[:4], 2),
            PeerRequest(requests[-1].prompt_token_ids[:8], 2),
        ]
        collect(manager, submit(manager, warm, "warmup-"))
        hits.tokens = 0
        start = time.perf_counter()
        request_ids = submit(manager, requests, "r")
        results = collect(manager, request_ids)
    ordered = [results[request_id] for request_id in request_ids]
    token_times = [[at - start for at in r.timestamps or []] for r in ordered]
    wall = max(times[-1] for times in token_times if times)
    logger.info("event=peer_done system=transformers-cb wall_s=%.2f prefix_hit_tokens=%d", wall, hits.tokens)
    return RunResult(
        system=f"transformers generate_batch (continuous batching, {attention})",
        wall_s=wall,
        outputs=[list(r.generated_tokens) for r in ordered],
        ttft_s=[times[0] for times in token_times],
        itl_s=[gap for times in token_times for gap in token_gaps(times)],
        itl_kind=ItlKind.PER_TOKEN,
        prompt_tokens_computed=sum(len(r.prompt_token_ids) for r in requests) - hits.tokens,
    )
