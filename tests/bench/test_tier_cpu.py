"""CPU per process from /proc: a child that spins is counted as a front-end of its parent, and
only what it used between two snapshots counts."""

import subprocess
import sys
import time

from bench.tier_cpu import TierCpu, children, cpu_seconds, snapshot, used_between

SPIN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\ntime.sleep(60)"


def test_a_spinning_child_is_counted_as_a_front_end_and_its_parent_as_the_planner() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN.format(seconds=0.5)!r}])"]
    )
    try:
        deadline = time.monotonic() + 30
        while not children(parent.pid):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.02)
        before = snapshot(parent.pid)
        (child,) = before.frontends_s
        while cpu_seconds(child) is not None and cpu_seconds(child) < 0.5:
            assert time.monotonic() < deadline, "the child never spun"
            time.sleep(0.02)
        used = used_between(before, snapshot(parent.pid))
    finally:
        parent.kill()
        parent.wait()
    assert used.frontends_counted == 1
    # The child spun 0.5 s of CPU in all, part of it before the first snapshot; the parent waited.
    assert 0.0 < used.frontends_s <= 0.5 + 0.05
    assert used.planner_s < 0.05


def test_a_front_end_gone_between_snapshots_is_left_out() -> None:
    used = used_between(TierCpu(1.0, {10: 2.0, 11: 3.0}), TierCpu(1.5, {10: 2.25, 12: 0.5}))
    assert (used.planner_s, used.frontends_s, used.frontends_counted) == (0.5, 0.25, 1)


def test_a_gone_process_has_no_cpu_seconds() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert cpu_seconds(process.pid) is None
