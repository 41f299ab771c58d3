"""service_support sits between the contract and the services: it may import protos/, never a
service package, and protos/ imports nothing of it. Read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("scheduler_service", "executor_service", "kv_manager", "clients", "bench")


def top_level_imports(package: str) -> dict[str, set[str]]:
    """Each module of the package, and the top-level packages its absolute imports name."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO_ROOT))] = names
    return found


def test_service_support_imports_no_service() -> None:
    imports = top_level_imports("service_support")
    assert "service_support/log_format.py" in imports
    offending = {module: names & set(SERVICES) for module, names in imports.items() if names & set(SERVICES)}
    assert offending == {}


def test_protos_imports_nothing_of_service_support() -> None:
    imports = top_level_imports("protos")
    assert "protos/limits.py" in imports
    assert [module for module, names in imports.items() if "service_support" in names] == []
