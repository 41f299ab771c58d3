"""The generated gRPC code is current, and the contracts keep their documented shape."""

import filecmp
import shutil
from pathlib import Path

from protos.generate import REPO_ROOT, generate, proto_sources
from protos.splitserve.executor.v1 import executor_pb2
from protos.splitserve.v1 import generation_pb2


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
    assert packages == {"splitserve.v1", "splitserve.executor.v1", "splitserve.planner.v1"}


def test_executor_and_client_token_logprobs_share_one_wire_format() -> None:
    """The scheduler passes the executor's logprob records to clients as bytes."""
    executor_fields = executor_pb2.TokenLogprob.DESCRIPTOR.fields
    client_fields = generation_pb2.TokenLogprob.DESCRIPTOR.fields
    # The client's record extends the executor's (the scheduler adds each token's bytes).
    assert _shape(executor_fields) == _shape(client_fields)[: len(executor_fields)]
    assert [f.name for f in client_fields[len(executor_fields) :]] == ["token_bytes", "top_token_bytes"]
    record = executor_pb2.TokenLogprob(
        token_id=7, logprob=-0.5, top_token_ids=[7, 3], top_logprobs=[-0.5, -1.25]
    )
    passed = generation_pb2.TokenLogprob.FromString(record.SerializeToString())
    assert (passed.token_id, passed.logprob) == (7, -0.5)
    assert list(passed.top_token_ids) == [7, 3] and list(passed.top_logprobs) == [-0.5, -1.25]


def _shape(fields: object) -> list[tuple[str, int, int, bool]]:
    return [(f.name, f.number, f.type, f.is_repeated) for f in fields]  # type: ignore[attr-defined]
