"""CPU seconds the scheduler tier's processes have used: the process a benchmark started (the
planner of an all-in-one scheduler, or the whole scheduler with --frontends 1) and its direct
children (the front-ends that process/all_in_one.py starts; it starts nothing else). Two snapshots
give the CPU each role spent over a window. Linux only (/proc).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("bench.tier_cpu")


@dataclass(slots=True, frozen=True)
class TierCpu:
    planner_s: float
    # Front-end pid -> its CPU seconds so far.
    frontends_s: dict[int, float]


@dataclass(slots=True, frozen=True)
class TierCpuUsed:
    """CPU seconds used between two snapshots."""

    planner_s: float
    frontends_s: float
    # Front-ends alive at both snapshots; one that died or was restarted in between is missing
    # some of its CPU, so a window where this falls short of the front-ends asked for is suspect.
    frontends_counted: int


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of the process (all its threads, not its children); None once it has gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; the fields after its last ")" do not.
    fields = stat.rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of proc(5)'s stat; after the command name, 12 and 13.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Direct children of every thread of the process (a child belongs to the thread that forked it)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def snapshot(pid: int) -> TierCpu:
    planner = cpu_seconds(pid)
    if planner is None:
        raise RuntimeError(f"the scheduler process {pid} has gone")
    frontends = {child: used for child in children(pid) if (used := cpu_seconds(child)) is not None}
    return TierCpu(planner, frontends)


def used_between(before: TierCpu, after: TierCpu) -> TierCpuUsed:
    common = before.frontends_s.keys() & after.frontends_s.keys()
    if len(common) != len(before.frontends_s) or len(common) != len(after.frontends_s):
        logger.warning(
            "event=frontends_changed_in_window before=%s after=%s",
            sorted(before.frontends_s), sorted(after.frontends_s),
        )
    return TierCpuUsed(
        planner_s=after.planner_s - before.planner_s,
        frontends_s=sum(after.frontends_s[pid] - before.frontends_s[pid] for pid in common),
        frontends_counted=len(common),
    )
