"""The built kernel library still asks memory for the rows its attention loops read next: GCC's
dead-code elimination once dropped every __builtin_prefetch of the shared attention code, and
the decode kernel then streamed its K/V ~1.7x slower with no test noticing (prefetch_row.h)."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from executor_service.kernels.cpu_kernels import load_kernel_library
from tests.helpers.c_kernels import load_or_skip

# The functions that walk K/V rows and ask for those ahead (kernels/attention_chunk.c).
ASKING = ("chunk_scores", "chunk_values_by_position")


def prefetches_by_function(library_path: str) -> dict[str, int]:
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", library_path], capture_output=True, text=True, check=True
    ).stdout
    counts: dict[str, int] = {}
    function = None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if header:
            function = header.group(1)
        elif function is not None and "prefetch" in line:
            counts[function] = counts.get(function, 0) + 1
    return counts


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the instruction checked is x86's")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the library with")
def test_the_attention_loops_that_ask_for_rows_ahead_hold_prefetch_instructions() -> None:
    library = load_or_skip(load_kernel_library)
    counts = prefetches_by_function(library._name)
    for function in ASKING:
        assert counts.get(function, 0) > 0, f"{function} asks for no row ahead: its prefetches were compiled out"
