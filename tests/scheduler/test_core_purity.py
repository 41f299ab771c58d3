"""The planning core and kv_manager import no torch, no gRPC, no transformers and no protobuf:
every one of their modules is imported in a fresh interpreter where importing those raises. A
scheduler process without a tokenizer loads no torch."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.service_process import REPO_ROOT

FORBIDDEN = ("torch", "grpc", "transformers", "google.protobuf")
PURE_PACKAGES = ("scheduler_service.core", "kv_manager")

_IMPORT_ALL = f"""
import importlib, importlib.abc, pkgutil, sys

FORBIDDEN = {FORBIDDEN!r}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
            raise ImportError(f"{{name}} is imported by the pure core")
        return None

sys.meta_path.insert(0, Refuse())
for package_name in {PURE_PACKAGES!r}:
    package = importlib.import_module(package_name)
    for module in pkgutil.walk_packages(package.__path__, package_name + "."):
        importlib.import_module(module.name)
        print(module.name)
"""


def test_the_planning_core_and_kv_manager_import_without_torch_grpc_or_protobuf() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    imported = set(run.stdout.split())
    assert {"scheduler_service.core.scheduler", "kv_manager.block_pool"} <= imported


_SERVE_WITHOUT_TOKENIZER = """
import sys
import scheduler_service.__main__ as main
args = main.parse_args(["--executor", "127.0.0.1:1"])
assert args.tokenizer is None
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_a_scheduler_without_a_tokenizer_does_not_load_torch() -> None:
    # torch is a second or more of every scheduler process's start and a few hundred MB of its
    # memory; only transformers' auto tokenizer (with --tokenizer) brings it in.
    run = subprocess.run(
        [sys.executable, "-c", _SERVE_WITHOUT_TOKENIZER], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
