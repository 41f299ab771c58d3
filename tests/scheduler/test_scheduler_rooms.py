"""The scheduler's code lies in rooms (the sub-packages of scheduler_service) that import only
downward: a module in a room imports its own room and the rooms before it in ROOMS, never one
after it nor a top-level module, type-checking and function-level imports included. The top
level holds at most 3 modules (the package, its command line and the command line's security
flags), and no scheduler module imports in a cycle. Read from the source with ast: nothing is
imported.

The order follows the roles of the scheduler tier. Grammars (structured) sit on the tokenizer
(text) and serve both the front-end, which compiles them, and the planner, which steps them. The client API (frontend) drives no executor,
so the engine (planner), which streams a request's tokens into its client's output stream when
both share a process, builds on it and not the reverse. Both ends of the Planner API (tier) build
on the two: a planner serves the engine to front-ends, a front-end's backend is a planner. Each
role's process (process) is put together from all of them, and the tools come last."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.package_rooms import import_cycle, layout_problems, upward_imports

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "scheduler_service"
# Lowest first.
ROOMS = (
    "core",
    "text",
    "structured",
    "frontend",
    "planner",
    "tier",
    "process",
    "replay",
    "launch",
)
MAX_TOP_LEVEL_MODULES = 3


def test_the_top_level_holds_at_most_three_modules_and_every_sub_package_is_a_room() -> None:
    assert layout_problems(REPO_ROOT, PACKAGE, ROOMS, MAX_TOP_LEVEL_MODULES) == []


def test_no_room_imports_a_higher_room_or_a_top_level_module() -> None:
    assert upward_imports(REPO_ROOT, PACKAGE, ROOMS) == []


def test_no_scheduler_module_imports_in_a_cycle() -> None:
    assert import_cycle(REPO_ROOT, PACKAGE) is None


@pytest.fixture
def house(tmp_path: Path) -> Path:
    """A small scheduler_service whose engine streams into the client API's output stream, as the
    real one does: the planner room importing the frontend room, which imports nothing yet."""
    package = tmp_path / PACKAGE
    for folder in (package, package / "frontend", package / "planner"):
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").write_text("")
    (package / "__main__.py").write_text("from scheduler_service.planner.engine import Engine\n")
    (package / "frontend" / "output_stream.py").write_text("import asyncio\n")
    (package / "planner" / "engine.py").write_text("from ..frontend.output_stream import OutputStream\n")
    assert upward_imports(tmp_path, PACKAGE, ROOMS) == [] and import_cycle(tmp_path, PACKAGE) is None
    return tmp_path


def test_the_client_api_importing_the_engine_is_found_even_for_type_checking_only(house: Path) -> None:
    (house / PACKAGE / "frontend" / "output_stream.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from scheduler_service.planner.engine import Engine\n"
    )
    assert upward_imports(house, PACKAGE, ROOMS) == [
        "scheduler_service.frontend.output_stream (frontend) imports scheduler_service.planner.engine "
        "(planner), a higher room"
    ]
