"""The executor's code lies in rooms (the sub-packages of executor_service) that import only
downward: a module in a room imports its own room and the rooms before it in ROOMS, never one
after it nor a top-level module, type-checking and function-level imports included. The top
level holds at most 10 modules (the entry points), and no executor module imports in a cycle.
Read from the source with ast: nothing is imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.package_rooms import import_cycle, layout_problems, upward_imports

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "executor_service"
# Lowest first.
ROOMS = (
    "kernels",
    "attention",
    "recurrent",
    "cpu_forward",
    "model",
    "sampling",
    "runner",
    "parallel",
    "serving",
    "startup",
)
MAX_TOP_LEVEL_MODULES = 10


def test_the_top_level_holds_at_most_ten_modules_and_every_sub_package_is_a_room() -> None:
    assert layout_problems(REPO_ROOT, PACKAGE, ROOMS, MAX_TOP_LEVEL_MODULES) == []


def test_no_room_imports_a_higher_room_or_a_top_level_module() -> None:
    assert upward_imports(REPO_ROOT, PACKAGE, ROOMS) == []


def test_no_executor_module_imports_in_a_cycle() -> None:
    assert import_cycle(REPO_ROOT, PACKAGE) is None


@pytest.fixture
def house(tmp_path: Path) -> Path:
    """A small executor_service with two rooms, the lower importing nothing yet."""
    package = tmp_path / PACKAGE
    for folder in (package, package / "kernels", package / "runner"):
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").write_text("")
    (package / "__main__.py").write_text("from executor_service.runner import model_runner\n")
    (package / "kernels" / "wrapper.py").write_text("import ctypes\n")
    (package / "runner" / "model_runner.py").write_text("from ..kernels import wrapper\n")
    assert upward_imports(tmp_path, PACKAGE, ROOMS) == [] and import_cycle(tmp_path, PACKAGE) is None
    return tmp_path


def test_an_upward_import_is_found_even_for_type_checking_only(house: Path) -> None:
    (house / PACKAGE / "kernels" / "wrapper.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from executor_service.runner.model_runner import ModelRunner\n"
    )
    assert upward_imports(house, PACKAGE, ROOMS) == [
        "executor_service.kernels.wrapper (kernels) imports executor_service.runner.model_runner "
        "(runner), a higher room"
    ]
    cycle = import_cycle(house, PACKAGE)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"executor_service.kernels.wrapper", "executor_service.runner.model_runner"}


def test_a_room_importing_an_entry_point_is_found(house: Path) -> None:
    (house / PACKAGE / "kernels" / "wrapper.py").write_text(
        "def main() -> None:\n    from executor_service import __main__\n"
    )
    assert upward_imports(house, PACKAGE, ROOMS) == [
        "executor_service.kernels.wrapper (kernels) imports executor_service.__main__, a top-level module"
    ]


def test_a_house_out_of_shape_is_named(house: Path) -> None:
    (house / PACKAGE / "stray.py").write_text("")
    (house / PACKAGE / "empty").mkdir()
    (house / PACKAGE / "empty" / "__init__.py").write_text("")
    assert layout_problems(house, PACKAGE, ("kernels", "runner", "empty", "sampling"), 1) == [
        "3 top-level modules, over 1: ['__init__.py', '__main__.py', 'stray.py']",
        "room sampling is missing",
        "room empty holds no module",
    ]
    assert layout_problems(house, PACKAGE, ("kernels",), 3) == [
        "empty is a sub-package but not a room",
        "runner is a sub-package but not a room",
    ]
