"""Fixtures the planner's structured-output tests share: GPT-2's tokenizer and grammars compiled
for it (tests/helpers/gpt2_grammars.py has its vocabulary and a bitmask's tokens)."""

from __future__ import annotations

import pytest

from scheduler_service.structured.grammars import Grammars
from scheduler_service.text.tokenizer import TextProcessor
from tests.helpers.tokenizer_assets import gpt2_tokenizer_dir


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> TextProcessor:
    return TextProcessor.from_pretrained(gpt2_tokenizer_dir(tmp_path_factory.mktemp("gpt2")))


@pytest.fixture(scope="module")
def grammars(text: TextProcessor) -> Grammars:
    return Grammars(text)
