"""The executor's code lies in rooms (the sub-packages of executor_service) that import only
downward: a module in a room imports its own room and the rooms before it in ROOMS, never one
after it nor a top-level module, type-checking and function-level imports included. The top
level holds at most 10 modules (the entry points), and no executor module imports in a cycle.
Read from the source with ast: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "executor_service"
# Lowest first.
ROOMS = (
    "kernels",
    "attention",
    "cpu_forward",
    "model",
    "sampling",
    "runner",
    "parallel",
    "serving",
    "startup",
)
MAX_TOP_LEVEL_MODULES = 10


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted((root / PACKAGE).rglob("*.py"))}


def imported_modules(path: Path, root: Path, modules: dict[str, Path]) -> set[str]:
    """The executor_service modules the file's imports name, wherever the import stands:
    `from M import x` names M.x where that is a module, else M."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
    return {module for module in found if module == PACKAGE or module.startswith(PACKAGE + ".")}


def room_of(module: str) -> str | None:
    """The room a module lies in; None for the package itself and its top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def upward_imports(root: Path) -> list[str]:
    rank = {room: index for index, room in enumerate(ROOMS)}
    modules = package_modules(root)
    found = []
    for importer, path in modules.items():
        room = room_of(importer)
        if room is None:
            continue
        for imported in sorted(imported_modules(path, root, modules)):
            target = room_of(imported)
            if target is None and imported != PACKAGE:
                found.append(f"{importer} ({room}) imports {imported}, a top-level module")
            elif target is not None and rank[target] > rank[room]:
                found.append(f"{importer} ({room}) imports {imported} ({target}), a higher room")
    return found


def import_cycle(root: Path) -> list[str] | None:
    modules = package_modules(root)
    graph = {
        name: sorted(imported for imported in imported_modules(path, root, modules) if imported in modules and imported != name)
        for name, path in modules.items()
    }
    done: set[str] = set()
    on_path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in on_path:
            return on_path[on_path.index(name) :] + [name]
        if name in done:
            return None
        on_path.append(name)
        for imported in graph[name]:
            cycle = visit(imported)
            if cycle is not None:
                return cycle
        on_path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle is not None:
            return cycle
    return None


def test_the_top_level_holds_at_most_ten_modules_and_every_sub_package_is_a_room() -> None:
    package = REPO_ROOT / PACKAGE
    top = sorted(path.name for path in package.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert {path.parent.name for path in package.glob("*/__init__.py")} == set(ROOMS)
    for room in ROOMS:
        assert any((package / room).glob("[!_]*.py")), f"{room} holds no module"


def test_no_room_imports_a_higher_room_or_a_top_level_module() -> None:
    assert upward_imports(REPO_ROOT) == []


def test_no_executor_module_imports_in_a_cycle() -> None:
    assert import_cycle(REPO_ROOT) is None


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
    assert upward_imports(tmp_path) == [] and import_cycle(tmp_path) is None
    return tmp_path


def test_an_upward_import_is_found_even_for_type_checking_only(house: Path) -> None:
    (house / PACKAGE / "kernels" / "wrapper.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from executor_service.runner.model_runner import ModelRunner\n"
    )
    assert upward_imports(house) == [
        "executor_service.kernels.wrapper (kernels) imports executor_service.runner.model_runner "
        "(runner), a higher room"
    ]
    cycle = import_cycle(house)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"executor_service.kernels.wrapper", "executor_service.runner.model_runner"}


def test_a_room_importing_an_entry_point_is_found(house: Path) -> None:
    (house / PACKAGE / "kernels" / "wrapper.py").write_text(
        "def main() -> None:\n    from executor_service import __main__\n"
    )
    assert upward_imports(house) == [
        "executor_service.kernels.wrapper (kernels) imports executor_service.__main__, a top-level module"
    ]
