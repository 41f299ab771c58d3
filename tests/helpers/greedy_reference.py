"""transformers' own greedy generation, the reference every end-to-end output is held to."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


class Reference:
    """transformers generate, greedy, EOS not ending generation (the requests set ignore_eos)."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self.cache:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
                )
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]
