"""The seed document's pictures of a schedule: the waiting and running queues per step, each
step's batch (prefill and decode tokens), KV-cache use and preemptions. Needs matplotlib (the
replay extra)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scheduler_service.replay.simulate import Replayed


@dataclass(slots=True)
class Plotted:
    """The series drawn, per timeline, so a test can check the picture says what it should."""

    waiting: dict[str, list[int]] = field(default_factory=dict)
    running: dict[str, list[int]] = field(default_factory=dict)
    prefill: dict[str, list[int]] = field(default_factory=dict)
    decode: dict[str, list[int]] = field(default_factory=dict)
    kv_used_pct: dict[str, list[float]] = field(default_factory=dict)
    preemptions: dict[str, list[int]] = field(default_factory=dict)


def draw(replays: Sequence[Replayed], path: Path, title: str) -> Plotted:
    try:
        import matplotlib
    except ImportError as missing:
        raise RuntimeError(f"--png needs matplotlib (pip install 'splitserve[replay]'): {missing}") from None
    # Files only: no display is needed or used.
    matplotlib.use("Agg")
    from matplotlib import pyplot

    plotted = Plotted()
    figure, (queues, batch, kv, preempted) = pyplot.subplots(4, 1, figsize=(10, 10), sharex=True)
    for replayed in replays:
        name = replayed.address
        steps = list(range(1, len(replayed.steps) + 1))
        series = replayed.steps
        plotted.waiting[name] = [s.waiting for s in series]
        plotted.running[name] = [s.running for s in series]
        plotted.prefill[name] = [s.prefill_tokens for s in series]
        plotted.decode[name] = [s.decode_tokens for s in series]
        plotted.kv_used_pct[name] = [100.0 * s.kv_used_blocks / replayed.config.num_kv_blocks for s in series]
        plotted.preemptions[name] = [s.preemptions for s in series]
        suffix = f" ({name})" if len(replays) > 1 else ""
        queues.step(steps, plotted.waiting[name], where="mid", label=f"waiting{suffix}")
        queues.step(steps, plotted.running[name], where="mid", label=f"running{suffix}")
        batch.bar(steps, plotted.prefill[name], label=f"prefill tokens{suffix}", alpha=0.8)
        batch.bar(steps, plotted.decode[name], bottom=plotted.prefill[name], label=f"decode tokens{suffix}", alpha=0.8)
        kv.plot(steps, plotted.kv_used_pct[name], label=f"KV blocks used{suffix}")
        preempted.step(steps, plotted.preemptions[name], where="mid", label=f"preemptions so far{suffix}")
    queues.set_ylabel("requests")
    batch.set_ylabel("tokens in step")
    kv.set_ylabel("KV used (%)")
    kv.set_ylim(0, 105)
    preempted.set_ylabel("preemptions")
    preempted.set_xlabel("step")
    for axes in (queues, batch, kv, preempted):
        axes.legend(loc="upper right", fontsize="small")
        axes.grid(alpha=0.3)
    for axes in (queues, batch, preempted):
        axes.yaxis.get_major_locator().set_params(integer=True)
        axes.set_ylim(bottom=0)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return plotted
