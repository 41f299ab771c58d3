"""Fixtures shared across test modules."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from executor_service.prepare_model import MODEL_NAME, prepare_model


@pytest.fixture(scope="session")
def prepared_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model (SmolLM2-135M-Instruct) prepared once per test run.

    Dequantizing its GGUF takes ~25 s, so every test that needs the real model should share this
    folder rather than prepare its own. It is built in a temp folder, never in the user's cache.
    Under pytest-xdist the workers share one folder beside their own temp folders: the first to
    take the lock prepares it, the others wait and find it complete.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    with (root / "prepared.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return prepare_model(root / "prepared" / MODEL_NAME)
