"""Models stay loaded by memory, not by count: a load that does not fit unloads the least recently
used idle model (one pinned with keep_alive -1 last, one with open requests never) until it fits."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from llmd.config import load_settings
from llmd.daemon import scheduler as sched
from llmd.models.memory import DoesNotFit


class _Worker:
    remote = False
    pid = 1

    def __init__(self) -> None:
        self.stopped = False

    def shutdown(self) -> None:
        self.stopped = True


def _scheduler(tmp_path: Path) -> sched.Scheduler:
    settings = load_settings({"home": tmp_path}, env={})
    return sched.Scheduler(settings, registry=None)  # type: ignore[arg-type]


def _loaded(s: sched.Scheduler, name: str, last_used: float, users: int = 0, pinned: bool = False) -> _Worker:
    w = _Worker()
    m = s.state(name)
    m.worker, m.last_used, m.users = w, last_used, users  # type: ignore[assignment]
    if pinned:
        m.keep_alive = None
    return w


def test_the_default_keeps_models_by_memory(tmp_path: Path):
    assert _scheduler(tmp_path).max_loaded == 0


def test_room_is_made_least_recently_used_first_pinned_last_busy_never(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    s = _scheduler(tmp_path)
    busy = _loaded(s, "agent", 1.0, users=1)
    pinned = _loaded(s, "editor", 2.0, pinned=True)
    old = _loaded(s, "chat", 3.0)
    newer = _loaded(s, "embed", 4.0)
    fits_when = {"left": 2}  # the new model fits once only two others are loaded

    def check_fit(name: str, *_a: Any) -> Any:
        if len(s.workers) > fits_when["left"]:
            raise DoesNotFit(f"{name} does not fit")
        return "estimate"

    monkeypatch.setattr(sched, "check_fit", check_fit)
    assert asyncio.run(s._fit("new", None, 1024, None, True)) == "estimate"  # type: ignore[arg-type]
    assert old.stopped and newer.stopped and not pinned.stopped and not busy.stopped
    fits_when["left"] = 0
    with pytest.raises(DoesNotFit):  # the pinned one goes too, the busy one never
        asyncio.run(s._fit("new", None, 1024, None, True))  # type: ignore[arg-type]
    assert pinned.stopped and not busy.stopped
