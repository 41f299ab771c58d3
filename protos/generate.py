"""Regenerates the Python gRPC code from the .proto sources: `python -m protos.generate`.

Run from any directory; output lands beside each .proto file. Imports in the generated code are
rooted at the repository (`from protos.splitserve.v1 import ...`), which is why protoc's include
path is the repository root.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent


def proto_sources(root: Path = REPO_ROOT) -> list[Path]:
    return sorted((root / "protos").rglob("*.proto"))


def generate(out_root: Path = REPO_ROOT) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every source under out_root/protos."""
    grpc_include = Path(protoc.__file__).resolve().parent / "_proto"
    sources = [str(p.relative_to(REPO_ROOT)) for p in proto_sources()]
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{grpc_include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
