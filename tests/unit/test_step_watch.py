"""When a running step is given up (backends/llamacpp/step_watch.py): for a newcomer of its burst,
for another model's more urgent work, for a more urgent request on its way to the same model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmd.backends.llamacpp.step_watch import BOARD_CHECK_S, StepWatch


@dataclass
class FakeEngine:
    interrupt: Callable[[], bool] | None = None
    urgent: Callable[[int], bool] | None = None
    outranked: Callable[[], bool] | None = None
    heartbeat: Callable[[], None] | None = None
    beats: list[float] = field(default_factory=list)


def _fresh(w: StepWatch) -> None:
    time.sleep(BOARD_CHECK_S * 1.5)  # the board and class counts are read at most this often


def test_an_agents_prompt_is_given_up_for_a_chat_on_its_way_but_not_for_an_equal_or_lower_class():
    on_way: list[int] = []  # the class indexes of requests on their way
    e = FakeEngine(urgent=lambda rank: any(c < rank for c in on_way))
    w = StepWatch(e)
    w.start(joinable=False, prompt_rank=1)  # an agent's prompt (llmd.priority: agent is 1)
    assert w() is False
    on_way.append(2)  # a background request: not above the agent
    _fresh(w)
    assert w() is False
    on_way.append(0)  # a person's chat
    _fresh(w)
    assert w() is True and w.preempting and w.for_newcomer
    w.given_up()
    assert w.info()["yields_to_urgent"] == 1 and w.info()["preemptions"] == 0


def test_an_interactive_or_aged_prompt_is_never_given_up_for_a_newcomer():
    e = FakeEngine(urgent=lambda rank: True)
    w = StepWatch(e)
    for rank in (0, -1):  # interactive, or a lower class that has waited its way up
        w.start(joinable=False, prompt_rank=rank)
        _fresh(w)
        assert w() is False
    w.start(joinable=False, prompt_rank=None)  # a step without a prompt
    _fresh(w)
    assert w() is False


def test_another_models_work_holds_the_step_where_it_is_until_that_work_is_done():
    """Given up, the step lost the micro-batch it was in; held, it goes on from the same operation."""
    until = time.perf_counter() + 0.2
    e = FakeEngine(outranked=lambda: time.perf_counter() < until)
    e.heartbeat = lambda: e.beats.append(time.monotonic())
    w = StepWatch(e)
    w.start(joinable=False, prompt_rank=1)
    _fresh(w)
    t0 = time.perf_counter()
    assert w() is False and not w.preempting  # back when the other model's work ended
    assert time.perf_counter() >= until and time.perf_counter() - t0 < 1.0
    assert w.info()["holds"] == 1 and w.info()["preemptions"] == 0 and 0.1 < w.step_held_s < 1.0
    assert len(e.beats) > 10  # the daemon hears from it while it waits


def test_a_step_held_too_long_is_given_up_and_counted_apart(monkeypatch):
    import llmd.backends.llamacpp.step_watch as sw

    monkeypatch.setattr(sw, "HOLD_MAX_S", 0.1)
    e = FakeEngine(outranked=lambda: True)
    w = StepWatch(e)
    w.start(joinable=False, prompt_rank=0)
    _fresh(w)
    assert w() is True and w.preempting and not w.for_newcomer
    w.given_up()
    assert w.info()["preemptions"] == 1 and w.info()["yields_to_urgent"] == 0 and w.info()["holds"] == 0


def test_a_held_step_gives_way_to_a_more_urgent_request_to_its_own_model():
    on_way: list[int] = []
    e = FakeEngine(outranked=lambda: True, urgent=lambda rank: any(c < rank for c in on_way))
    w = StepWatch(e)
    w.start(joinable=False, prompt_rank=1)
    _fresh(w)
    threading.Timer(0.1, on_way.append, (0,)).start()  # a person's chat to this model, while held
    t0 = time.perf_counter()
    assert w() is True and w.preempting and w.for_newcomer
    assert time.perf_counter() - t0 < 1.0


def test_a_newcomer_joins_only_while_the_step_is_joinable_and_the_heartbeat_goes_out():
    e = FakeEngine(interrupt=lambda: True)
    e.heartbeat = lambda: e.beats.append(time.monotonic())
    w = StepWatch(e)
    w.join_until = time.perf_counter() + 60
    w.start(joinable=True, prompt_rank=None)
    assert w() is True and not w.preempting
    w.start(joinable=False, prompt_rank=None)
    assert w() is False
    assert len(e.beats) == 2
