"""The default model is prepared once from its GGUF file and answers like the original."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from executor_service.prepare_model import (
    COMPLETE_MARKER,
    RECOMMENDED_SAMPLING,
    is_prepared,
    prepare_model,
)
from scheduler_service.text.generation_config import load_sampling_defaults


@pytest.fixture
def prepared(prepared_model: Path) -> Path:
    """The session's prepared model (tests/conftest.py): its first preparation is the real one."""
    return prepared_model


def test_folder_is_complete(prepared: Path) -> None:
    names = {p.name for p in prepared.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", COMPLETE_MARKER} <= names
    assert "tokenizer.json" in names
    # No temp folder is left beside the result.
    assert [p.name for p in prepared.parent.iterdir()] == [prepared.name]


def test_second_call_returns_at_once(prepared: Path) -> None:
    started = time.monotonic()
    assert prepare_model(prepared) == prepared
    assert time.monotonic() - started < 1.0


def test_generation_config_holds_the_model_cards_sampling(prepared: Path) -> None:
    defaults = load_sampling_defaults(prepared)
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (0.2, 0.9, 1.1)
    assert defaults.top_k == 0 and defaults.max_tokens is None
    config = json.loads((prepared / "generation_config.json").read_text())
    assert config["eos_token_id"] == 2


def test_a_folder_prepared_before_the_sampling_defaults_gets_them(prepared: Path, tmp_path: Path) -> None:
    older = tmp_path / "older"
    shutil.copytree(prepared, older, ignore=shutil.ignore_patterns("*.safetensors"))
    config_path = older / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({k: v for k, v in config.items() if k not in RECOMMENDED_SAMPLING}))
    assert load_sampling_defaults(older).temperature == 1.0
    assert prepare_model(older) == older
    assert json.loads(config_path.read_text()) == config


def test_incomplete_folder_is_not_taken_as_ready(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert not is_prepared(tmp_path)


def test_greedy_chat_answer(prepared: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared)
    model = AutoModelForCausalLM.from_pretrained(prepared)
    assert model.generation_config.eos_token_id == 2
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    # Generation ended on <|im_end|> rather than on the token limit.
    assert output[0, -1].item() == 2
