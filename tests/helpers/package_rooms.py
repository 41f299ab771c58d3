"""A package's rooms (its sub-packages, in an order from lowest to highest) and the imports that
break it: a room's module importing a higher room or one of the package's top-level modules, and
import cycles between the package's modules. Read from the source with ast: nothing is imported.
The room tests of executor_service and scheduler_service share it."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path, package: str) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


def imported_modules(path: Path, root: Path, modules: dict[str, Path], package: str) -> set[str]:
    """The package's modules the file's imports name, wherever the import stands:
    `from M import x` names M.x where that is a module, else M."""
    name = module_name(path, root)
    parent = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parent.rsplit(".", node.level - 1)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
    return {module for module in found if module == package or module.startswith(package + ".")}


def room_of(module: str, rooms: Sequence[str]) -> str | None:
    """The room a module lies in; None for the package itself and its top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in rooms else None


def layout_problems(root: Path, package: str, rooms: Sequence[str], max_top_level_modules: int) -> list[str]:
    """What breaks the house's shape: too many top-level modules, a sub-package that is not a
    room, a room that is missing or holds no module."""
    folder = root / package
    top = sorted(path.name for path in folder.glob("*.py"))
    problems = [f"{len(top)} top-level modules, over {max_top_level_modules}: {top}"] if len(top) > max_top_level_modules else []
    found = {path.parent.name for path in folder.glob("*/__init__.py")}
    problems += [f"{name} is a sub-package but not a room" for name in sorted(found - set(rooms))]
    problems += [f"room {name} is missing" for name in rooms if name not in found]
    problems += [f"room {name} holds no module" for name in rooms if name in found and not any((folder / name).glob("[!_]*.py"))]
    return problems


def upward_imports(root: Path, package: str, rooms: Sequence[str]) -> list[str]:
    rank = {room: index for index, room in enumerate(rooms)}
    modules = package_modules(root, package)
    found = []
    for importer, path in modules.items():
        room = room_of(importer, rooms)
        if room is None:
            continue
        for imported in sorted(imported_modules(path, root, modules, package)):
            target = room_of(imported, rooms)
            if target is None and imported != package:
                found.append(f"{importer} ({room}) imports {imported}, a top-level module")
            elif target is not None and rank[target] > rank[room]:
                found.append(f"{importer} ({room}) imports {imported} ({target}), a higher room")
    return found


def import_cycle(root: Path, package: str) -> list[str] | None:
    modules = package_modules(root, package)
    graph = {
        name: sorted(imported for imported in imported_modules(path, root, modules, package) if imported in modules and imported != name)
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
