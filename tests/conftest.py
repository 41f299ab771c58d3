"""Fixtures shared across test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_service.prepare_model import MODEL_NAME, prepare_model


@pytest.fixture(scope="session")
def prepared_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model (SmolLM2-135M-Instruct) prepared once per test session.

    Dequantizing its GGUF takes ~25 s, so every test that needs the real model should share this
    folder rather than prepare its own. It is built in a temp folder, never in the user's cache.
    """
    return prepare_model(tmp_path_factory.mktemp("prepared") / MODEL_NAME)
