"""The peer: transformers' static batched greedy `generate` on the same model and prompts, in this
process (left-padded, one batch, EOS disabled so every row runs all new tokens). Requests that
want fewer tokens than the longest ride along in the batch and keep only their own.

Plain greedy, as every other system runs: the model folder's own generation defaults are
dropped. generate() applies them even with do_sample=False, and SmolLM2 ships
repetition_penalty 1.1, which made this peer's tokens diverge from every other system's within
the first dozen on all 32 requests of the fixed workload."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)

from bench.throughput_workload import SystemResult

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepClock(LogitsProcessor):
    """Notes when generate scores logits: call i picks output token i of every row, so the first
    call ends the prefill (every row's TTFT)."""

    calls: list[float] = field(default_factory=list)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls.append(time.perf_counter())
        return scores


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, clock: StepClock) -> torch.Tensor:
    pad_id = model.generation_config.pad_token_id or 0
    ids, mask = left_padded(prompts, pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    return out[:, ids.shape[1] :]


def run_transformers(
    model_dir: Path,
    prompts: list[list[int]],
    new_tokens: list[int],
    threads: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    warm_up: tuple[list[list[int]], list[int]] | None = None,
) -> SystemResult:
    """prompts[i] wants new_tokens[i] tokens; the batch runs the most any request wants.
    warm_up: prompts and token counts generated the same way first, untimed; without it, two
    short rows."""
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    # No EOS: every row runs all its tokens, as splitserve's requests do with ignore_eos. Nothing
    # else of the folder's generation config either (no penalties, no sampling defaults).
    model.generation_config = GenerationConfig(pad_token_id=model.generation_config.pad_token_id, eos_token_id=None)
    # Warm-up outside the timing (first-call allocations and kernel selection), as splitserve gets.
    if warm_up is None:
        generate(model, [prompts[0][:8], prompts[-1][:4]], 2, StepClock())
    else:
        generate(model, warm_up[0], max(warm_up[1]), StepClock())
    clock = StepClock()
    start = time.perf_counter()
    tokens = generate(model, prompts, max(new_tokens), clock)
    wall = time.perf_counter() - start
    outputs = [row[:wanted] for row, wanted in zip(tokens.tolist(), new_tokens, strict=True)]
    steps = [at - start for at in clock.calls]
    logger.info("event=peer_done system=transformers wall_s=%.2f", wall)
    return SystemResult(
        system="transformers generate (static batch)",
        wall_s=wall,
        output_tokens=sum(len(o) for o in outputs),
        ttft_s=[steps[0]] * len(prompts),
        outputs=outputs,
        token_times_s=[steps[: len(o)] for o in outputs],
    )
