"""When a running step is given up (backends/llamacpp/step_watch.py): for a newcomer of its burst,
for another model's more urgent work, for a more urgent request on its way to the same model."""

from __future__ import annotations

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


def test_another_models_work_preempts_and_is_counted_apart():
    e = FakeEngine(outranked=lambda: True)
    w = StepWatch(e)
    w.start(joinable=False, prompt_rank=0)
    _fresh(w)
    assert w() is True and w.preempting and not w.for_newcomer
    w.given_up()
    assert w.info()["preemptions"] == 1 and w.info()["yields_to_urgent"] == 0


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
