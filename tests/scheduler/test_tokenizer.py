"""TextProcessor over real tokenizer folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scheduler_service.text.tokenizer import TextProcessor
from tests.helpers.tokenizer_assets import gpt2_tokenizer_dir, qwen3_tokenizer_dir

QWEN_IM_END = 151645
QWEN_ENDOFTEXT = 151643


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> TextProcessor:
    return TextProcessor.from_pretrained(gpt2_tokenizer_dir(tmp_path_factory.mktemp("gpt2")))


@pytest.fixture(scope="module")
def qwen3() -> TextProcessor:
    return TextProcessor.from_pretrained(qwen3_tokenizer_dir())


def test_encode_decode_and_pieces(gpt2: TextProcessor) -> None:
    ids = gpt2.encode("Hello world")
    assert ids == [15496, 995]
    assert gpt2.decode(ids) == "Hello world"
    assert gpt2.token_pieces(ids) == ["Hello", "Ġworld"]
    assert gpt2.eos_token_ids == (50256,)
    assert not gpt2.has_chat_template


def test_chat_without_template_is_refused(gpt2: TextProcessor) -> None:
    with pytest.raises(ValueError, match="chat template"):
        gpt2.encode_chat([("user", "hi")], add_generation_prompt=True)


def test_chat_renders_the_template(qwen3: TextProcessor) -> None:
    assert qwen3.has_chat_template
    as_tuples = qwen3.encode_chat([("user", "What is 2+2?")], add_generation_prompt=True)
    as_dicts = qwen3.encode_chat(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True
    )
    without_prompt = qwen3.encode_chat([("user", "What is 2+2?")], add_generation_prompt=False)

    assert as_tuples == as_dicts
    text = qwen3.decode(as_tuples, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nWhat is 2+2?<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert len(without_prompt) < len(as_tuples)
    # Special tokens in the rendered template become their single ids, not their spelling.
    assert as_tuples.count(QWEN_IM_END) == 1


def test_eos_ids_include_the_generation_config(tmp_path: Path) -> None:
    folder = tmp_path / "qwen"
    shutil.copytree(qwen3_tokenizer_dir(), folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [QWEN_IM_END, QWEN_ENDOFTEXT]})
    )
    processor = TextProcessor.from_pretrained(folder)
    assert set(processor.eos_token_ids) == {QWEN_IM_END, QWEN_ENDOFTEXT}
