"""The scheduler's processes run on uvloop by default (auto: where it is installed, and it is a
dependency), on asyncio's loop when asked for, and refuse to start when uvloop is asked for and
missing."""

import asyncio
import importlib.util

import pytest
import uvloop

from scheduler_service.process.event_loop import event_loop_runner


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_asyncios_loop() -> None:
    assert event_loop_runner("auto")(_loop_type()) is uvloop.Loop
    assert event_loop_runner("uvloop")(_loop_type()) is uvloop.Loop
    assert not issubclass(event_loop_runner("asyncio")(_loop_type()), uvloop.Loop)


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert event_loop_runner("auto") is asyncio.run
    with pytest.raises(ValueError, match="uvloop is not installed"):
        event_loop_runner("uvloop")
