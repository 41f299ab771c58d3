"""The C kernels' cache: a folder of this user's alone, and nothing in it loaded that someone else
could have written. A planted library (one whose constructor writes a marker file, so a test can
tell it never ran) in a shared folder is refused and the executor serves without it; a corrupt
library is refused and rebuilt; a group-writable folder is refused for the private default."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from executor_service.attention.paged_attention import select_backend
from executor_service.kernels.cpu_kernels import (
    REQUIRED_SYMBOLS,
    KernelUnavailable,
    build_kernel,
    kernel_library_name,
    open_library,
)
from executor_service.kernels.kernel_cache import (
    CacheFolder,
    candidate_folders,
    folder_refusal,
    library_refusal,
)
from protos.splitserve.executor.v1 import executor_pb2 as pb
from protos.splitserve.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.helpers.c_kernels import load_or_skip
from tests.helpers.executor_driver import PlanStream
from tests.helpers.executor_process import ExecutorProcess
from tests.helpers.executor_token import token_channel
from tests.helpers.model_factory import build_model

REFUSED = "event=kernel_cache_refused"
# Someone else: uid 65534 is "nobody" on the common distributions.
STRANGER = 65534
PLANTED_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker != NULL) { fputs("the planted library ran", marker); fclose(marker); }
}
int not_a_kernel(void) { return 0; }
"""


@pytest.fixture(scope="module")
def built_library() -> Path:
    """This machine's real library (from the user's own cache, built there if missing); the
    tests that need one skip where no compiler can build it."""
    return load_or_skip(build_kernel)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("kernel-cache") / "llama")


def plant(library: Path, marker: Path) -> None:
    """A shared library at `library` whose constructor writes `marker` when it is loaded."""
    source = library.with_suffix(".c")
    source.write_text(PLANTED_SOURCE)
    compiler = os.environ.get("CC", "cc")
    command = [compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True)
    source.unlink()


@pytest.fixture
def planted(tmp_path: Path, built_library: Path) -> tuple[Path, Path]:
    """(library, marker): a library planted under tmp_path, and the file it writes if it runs."""
    library, marker = tmp_path / "planted.so", tmp_path / "planted-ran"
    plant(library, marker)
    return library, marker


@contextmanager
def started(model_dir: Path, env: dict[str, str | None]) -> Iterator[tuple[ExecutorProcess, pb.ExecutorInfo]]:
    """An executor started with `env`'s changes to its environment, once it has described itself
    and run a step (it serves); stopped on exit."""
    executor = ExecutorProcess(model_dir, env=env, num_kv_blocks=16, block_size=8)
    try:
        with token_channel(executor.wait_ready()) as channel:
            info = pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest())
            stream = PlanStream(channel)
            new = pb.NewRequest(request_id="r", token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3)
            assert stream.step(pb.StepPlan(step_id=1, new_requests=[new])).outputs[0].token_ids
            stream.close()
        yield executor, info
    finally:
        executor.close()


def test_the_cache_folder_is_per_user(tmp_path: Path) -> None:
    uid = os.geteuid()
    temp = Path(tempfile.gettempdir())
    own_temp = CacheFolder(temp / f"splitserve-kernels-{uid}", temp)
    assert candidate_folders({}) == [own_temp]
    home = tmp_path / "home"
    assert candidate_folders({"HOME": str(home)}) == [
        CacheFolder(home / ".cache" / "splitserve" / "kernels", home / ".cache"),
        own_temp,
    ]
    xdg = tmp_path / "xdg"
    explicit = tmp_path / "explicit"
    assert candidate_folders(
        {"HOME": str(home), "XDG_CACHE_HOME": str(xdg), "SPLITSERVE_KERNEL_CACHE": str(explicit)}
    ) == [
        CacheFolder(explicit, tmp_path),
        CacheFolder(xdg / "splitserve" / "kernels", xdg),
        own_temp,
    ]
    # XDG's rule: a relative base is ignored.
    assert candidate_folders({"XDG_CACHE_HOME": "relative"}) == [own_temp]


def test_missing_folders_are_created_private(tmp_path: Path) -> None:
    base = tmp_path / "home" / ".cache"
    folder = CacheFolder(base / "splitserve" / "kernels", base)
    old = os.umask(0)
    try:
        # Even with no umask at all: the folders are made 0700, not left to it.
        assert folder_refusal(folder) is None
    finally:
        os.umask(old)
    for path in (tmp_path / "home", base, base / "splitserve", folder.path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def test_what_others_can_write_or_own_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "base"
    shared = base / "shared"
    shared.mkdir(parents=True)
    shared.chmod(0o775)
    assert "writable by its group or others (mode 0775)" in str(folder_refusal(CacheFolder(shared, base)))
    # A private folder under one the group can write: that one could be swapped from under us.
    inner = shared / "inner"
    inner.mkdir(mode=0o700)
    assert "shared is writable" in str(folder_refusal(CacheFolder(inner, base)))
    shared.chmod(0o755)
    assert folder_refusal(CacheFolder(inner, base)) is None

    library = inner / "cpu-kernels-x.so"
    library.write_bytes(b"x")
    library.chmod(0o664)
    assert "writable by its group or others" in str(library_refusal(library))
    library.chmod(0o644)
    assert library_refusal(library) is None
    link = inner / "cpu-kernels-y.so"
    link.symlink_to(library)
    assert "not a plain file" in str(library_refusal(link))
    if os.geteuid() == 0:
        os.chown(library, STRANGER, STRANGER)
        assert f"owned by uid {STRANGER}" in str(library_refusal(library))
        os.chown(inner, STRANGER, STRANGER)
        assert f"owned by uid {STRANGER}" in str(folder_refusal(CacheFolder(inner, base)))


def test_a_library_without_the_kernels_is_refused(planted: tuple[Path, Path]) -> None:
    library, _ = planted
    with pytest.raises(KernelUnavailable, match=f"lacks {REQUIRED_SYMBOLS[0]}"):
        open_library(library)
    corrupt = library.with_name("corrupt.so")
    corrupt.write_bytes(os.urandom(4096))
    with pytest.raises(KernelUnavailable, match="cannot load"):
        open_library(corrupt)


def test_a_library_planted_in_a_shared_temp_folder_never_runs_and_the_executor_serves(
    tmp_path: Path, model_dir: Path, planted: tuple[Path, Path]
) -> None:
    # No home: the cache would be <temp>/splitserve-kernels-<uid>, which another user made first.
    temp = tmp_path / "temp"
    temp.mkdir()
    folder = temp / f"splitserve-kernels-{os.geteuid()}"
    folder.mkdir()
    library, marker = planted
    shutil.copy(library, folder / kernel_library_name())
    if os.geteuid() == 0:
        for path in (folder, folder / kernel_library_name()):
            os.chown(path, STRANGER, STRANGER)
    else:
        # Not root: no file can be given away; a folder anyone may write stands for it.
        folder.chmod(0o777)
    env = {"HOME": None, "XDG_CACHE_HOME": None, "SPLITSERVE_KERNEL_CACHE": None, "TMPDIR": str(temp)}
    with started(model_dir, env) as (executor, info):
        log = executor.log_text()
        assert not marker.exists(), "the planted library ran inside the executor"
        assert log.count(REFUSED) == 1, log
        assert f"{REFUSED} path={folder} " in log
        # With no private folder to build in, the executor runs as it does without a compiler.
        assert info.attention_backend == "sdpa"
        assert "event=cpu_kernels_unavailable" in log


def test_a_corrupt_library_is_refused_and_rebuilt(
    tmp_path: Path, model_dir: Path, built_library: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    library = cache / kernel_library_name()
    library.write_bytes(os.urandom(64 * 1024))
    library.chmod(0o600)
    with started(model_dir, {"SPLITSERVE_KERNEL_CACHE": str(cache)}) as (executor, info):
        log = executor.log_text()
        assert log.count(REFUSED) == 1, log
        assert f"{REFUSED} path={library} reason='cannot load" in log
        assert f"event=cpu_kernels_built path={library}" in log
        assert info.attention_backend == select_backend(torch.device("cpu"), torch.float32)
    assert library.read_bytes()[:4] == b"\x7fELF"
    assert [p.name for p in cache.iterdir()] == [library.name]


def test_a_group_writable_cache_folder_is_refused_for_the_private_default(
    tmp_path: Path, model_dir: Path, built_library: Path, planted: tuple[Path, Path]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    library, marker = planted
    shutil.copy(library, shared / kernel_library_name())
    # The private default already holds this machine's library, so nothing is compiled.
    home = tmp_path / "home"
    own = home / ".cache" / "splitserve" / "kernels"
    own.mkdir(parents=True, mode=0o700)
    shutil.copy(built_library, own / kernel_library_name())
    env = {"SPLITSERVE_KERNEL_CACHE": str(shared), "HOME": str(home), "XDG_CACHE_HOME": None}
    with started(model_dir, env) as (executor, info):
        log = executor.log_text()
        assert not marker.exists(), "the planted library ran inside the executor"
        assert log.count(REFUSED) == 1, log
        assert f"{REFUSED} path={shared} reason=" in log and "writable by its group or others" in log
        assert "event=cpu_kernels_built" not in log
        assert info.attention_backend == select_backend(torch.device("cpu"), torch.float32)
