"""The default model is prepared once from its GGUF file and answers like the original."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from executor_service.prepare_model import COMPLETE_MARKER, is_prepared, prepare_model


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
