"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.compose_services import RunningServices


@pytest.fixture
def running(tmp_path: Path) -> Iterator[RunningServices]:
    """Compose services started as local processes, stopped as `docker compose down` does."""
    services = RunningServices(tmp_path)
    yield services
    services.stop()
