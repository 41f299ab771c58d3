"""A multimodal checkpoint as people download it (a ...ForConditionalGeneration folder: text model,
vision tower, projector) serves its text model: greedy tokens through a real executor and
scheduler equal the published model's own generate on text alone. mllama's causal-LM class takes
only the text half of the config; gemma3's takes the whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from bench.architecture_survey import tiny_config
from tests.helpers.executor_process import start_executor
from tests.helpers.greedy_client import generate_greedy
from tests.helpers.scheduler_process import start_scheduler

PROMPTS = [[5], [7, 300, 12, 40, 2 + 9], [(13 * i) % 900 + 3 for i in range(37)], [(7 * i) % 800 + 3 for i in range(61)]]
NEW_TOKENS = 8
torch.set_num_threads(1)


def published(model_type: str, folder: Path) -> Path:
    config = tiny_config(CONFIG_MAPPING[model_type])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    return folder


def reference(folder: Path) -> list[list[int]]:
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("model_type", ["mllama", "gemma3"])
def test_a_published_multimodal_checkpoint_serves_its_text_model(model_type: str, tmp_path: Path) -> None:
    folder = published(model_type, tmp_path / model_type)
    expected = reference(folder)
    with start_executor(folder, num_kv_blocks=128) as (executor, _), start_scheduler(executor) as scheduler:
        assert generate_greedy(scheduler, PROMPTS, NEW_TOKENS) == expected
