"""The peer: transformers' static batched greedy `generate` on the same model and prompts, in this
process (left-padded, one batch, EOS disabled so every row runs all new tokens)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from bench.throughput_workload import SystemResult

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FirstCallClock(LogitsProcessor):
    """Notes when generate first scores logits: the end of the prefill, i.e. every row's TTFT."""

    first_call: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.first_call is None:
            self.first_call = time.perf_counter()
        return scores


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, clock: FirstCallClock) -> torch.Tensor:
    pad_id = model.generation_config.pad_token_id or 0
    ids, mask = left_padded(prompts, pad_id)
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


def run_transformers(model_dir: Path, prompts: list[list[int]], new_tokens: int, threads: int) -> SystemResult:
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # No EOS: every row runs new_tokens, as splitserve's requests do with ignore_eos.
    model.generation_config.eos_token_id = None
    # Warm-up outside the timing (first-call allocations and kernel selection), as splitserve gets.
    generate(model, [prompts[0][:8], prompts[-1][:4]], 2, FirstCallClock())
    clock = FirstCallClock()
    start = time.perf_counter()
    tokens = generate(model, prompts, new_tokens, clock)
    wall = time.perf_counter() - start
    outputs = tokens.tolist()
    ttft = (clock.first_call or start) - start
    logger.info("event=peer_done system=transformers wall_s=%.2f", wall)
    return SystemResult(
        system="transformers generate (static batch)",
        wall_s=wall,
        output_tokens=sum(len(o) for o in outputs),
        ttft_s=[ttft] * len(prompts),
        outputs=outputs,
    )
