"""The default model (SmolLM2-135M) through real executor and scheduler processes: four concurrent
requests with prompts of up to 700 tokens, prefilled in chunks under a small token budget, then
300 greedy tokens each. Every token must be transformers' argmax at its position, checked by
teacher forcing (one forward of prompt + output), or tie with it within 1e-3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.executor_process import start_executor
from tests.helpers.greedy_client import generate_greedy
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import REPO_ROOT

NEW_TOKENS = 300
PROMPT_TOKENS = (90, 310, 520, 700)
# Below the longest prompts, so they are prefilled over several steps beside the others' decodes.
TOKEN_BUDGET = 256
# How far below the top logit a produced token may be: a tie broken differently by kernels.
TIE_TOLERANCE = 1e-3

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def prompts(prepared_model: Path) -> list[list[int]]:
    """Real English (this project's README) cut to each length, as chat-free prompts."""
    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    text = (REPO_ROOT / "README.md").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 4 * max(PROMPT_TOKENS)
    return [ids[i * 700 : i * 700 + n] for i, n in enumerate(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def service(prepared_model: Path) -> Iterator[str]:
    with start_executor(prepared_model, num_kv_blocks=512, block_size=16) as (executor, _):
        with start_scheduler(executor, max_num_batched_tokens=TOKEN_BUDGET) as address:
            yield address


def test_every_token_is_transformers_argmax_under_teacher_forcing(
    service: str, prepared_model: Path, prompts: list[list[int]]
) -> None:
    outputs = generate_greedy(service, prompts, NEW_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(prepared_model, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output) == NEW_TOKENS
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
        chosen = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
        shortfall = logits.max(dim=1).values - chosen
        worst = int(shortfall.argmax())
        assert float(shortfall[worst]) <= TIE_TOLERANCE, (
            f"prompt of {len(prompt)} tokens: output token {worst} is {float(shortfall[worst]):.4g} "
            "below transformers' argmax"
        )
