"""The thread governor: one thread given up per core other programs keep busy, taken back after
two quiet checks; a fixed count never moves."""

from __future__ import annotations

import pytest

from llmd.backends.llamacpp import threads as T
from llmd.backends.llamacpp.threads import ThreadGovernor, _Sample


class Machine:
    """Scripted CPU counters: each tick advances wall time by CHECK_S with `others` cores busy elsewhere."""

    def __init__(self) -> None:
        self.wall = self.busy = self.own = 0.0

    def tick(self, others: float, own: float = 1.0) -> _Sample:
        self.wall += T.CHECK_S
        self.busy += (others + own) * T.CHECK_S
        self.own += own * T.CHECK_S
        return _Sample(self.wall, self.busy, self.own)


@pytest.fixture
def gov(monkeypatch: pytest.MonkeyPatch) -> tuple[ThreadGovernor, Machine, list[float]]:
    m = Machine()
    load: list[float] = [0.0]
    g = ThreadGovernor(4)
    monkeypatch.setattr(g, "_sample", lambda now=None: m.tick(load[0]))
    monkeypatch.setattr(T.time, "perf_counter", lambda: m.wall + T.CHECK_S)
    g._last = _Sample(0.0, 0.0, 0.0)
    return g, m, load


def test_gives_up_a_thread_per_busy_core_at_once(gov):
    g, _, load = gov
    assert g.check() is None and g.threads == 4  # quiet
    load[0] = 1.0
    assert g.check() == 3 and "keep 1.0" in g.reason
    load[0] = 2.6
    assert g.check() == 1
    load[0] = 9.0
    assert g.check() is None and g.threads == 1  # never below one


def test_a_light_load_keeps_every_thread(gov):
    g, _, load = gov
    load[0] = T.TAKEN - 0.05
    assert g.check() is None and g.threads == 4


def test_takes_threads_back_after_quiet_checks(gov):
    g, _, load = gov
    load[0] = 2.0
    assert g.check() == 2
    load[0] = 0.0
    assert g.check() is None  # one quiet check is not enough
    assert g.check() == 4 and g.changes == 2
    assert g.info()["threads"] == 4 and g.info()["auto"] is True


def test_a_burst_between_quiet_checks_does_not_flap(gov):
    g, _, load = gov
    load[0] = 1.0
    assert g.check() == 3
    for burst in (0.0, 1.0, 0.0, 1.0):
        load[0] = burst
        assert g.check() is None
    assert g.threads == 3


def test_fixed_never_changes():
    g = ThreadGovernor(2, fixed="LLMD_THREADS")
    assert g.check() is None and g.info() == {**g.info(), "threads": 2, "auto": False}
    assert g.reason == "fixed at 2 (LLMD_THREADS)"


def test_back_from_idle_starts_at_the_full_count(gov, monkeypatch: pytest.MonkeyPatch):
    """A long window holds what ran before the request (a build that ended): not decided on."""
    g, m, load = gov
    load[0] = 1.5
    assert g.check() == 2
    m.wall += 5.0  # idle for five seconds, a burst meanwhile
    m.busy += 5.0 * 2
    assert g.check() == 4 and "back from idle" in g.reason
    assert g.check() == 2  # busy still: the next window, the request's own, decides


def test_a_window_never_spans_time_the_engine_waited(gov):
    """Another program's burst while the engine waited between two requests (a peer server's turn)
    is not contention: the window starts again with the next step, at the count it had."""
    g, m, load = gov
    assert g.check() is None and g.threads == 4
    g.done()
    m.wall += 0.5  # the engine waits half a second; another program keeps 2 cores busy meanwhile
    m.busy += 0.5 * 2
    assert g.check() is None and g.threads == 4  # not decided on that half second
    load[0] = 0.0
    assert g.check() is None and g.threads == 4  # the request's own window: quiet
    load[0] = 2.0
    assert g.check() == 2  # contention while the engine works is still seen at once


def test_back_to_back_steps_keep_one_window(gov):
    g, m, load = gov
    load[0] = 2.0
    g.done()  # the next check comes within IDLE_GAP_S (the fixture's clock does not move between)
    assert g.check() == 2
