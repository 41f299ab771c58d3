"""The generated gRPC code is current, and the contracts keep their documented shape."""

import filecmp
import shutil
from pathlib import Path

from protos.generate import REPO_ROOT, generate, proto_sources


def test_generated_code_matches_the_proto_sources(tmp_path: Path) -> None:
    for source in proto_sources():
        target = tmp_path / source.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, target)
    generate(tmp_path)
    generated = sorted(p for p in tmp_path.rglob("*") if p.suffix in {".py", ".pyi"})
    assert len(generated) == 3 * len(proto_sources())
    stale = [
        str(p.relative_to(tmp_path))
        for p in generated
        if not filecmp.cmp(p, REPO_ROOT / p.relative_to(tmp_path), shallow=False)
    ]
    assert not stale, f"generated code is stale, run `make protos`: {stale}"


def test_every_message_and_field_is_documented() -> None:
    undocumented = []
    for source in proto_sources():
        lines = source.read_text().splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "package", "option", "//"))
            is_decl = stripped.startswith(("rpc ", "enum ", "message ", "service "))
            if (is_field or is_decl) and not lines[number - 1].strip().startswith("//"):
                undocumented.append(f"{source.name}:{number + 1}: {stripped}")
    assert not undocumented, "\n".join(undocumented)


def test_packages_are_versioned() -> None:
    packages = {
        line.split()[1].rstrip(";")
        for source in proto_sources()
        for line in source.read_text().splitlines()
        if line.startswith("package ")
    }
    assert packages == {"splitserve.v1", "splitserve.executor.v1"}
