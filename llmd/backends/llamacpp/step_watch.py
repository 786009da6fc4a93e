"""When a running step is given up between llama.cpp's graph operations, and for whom (issue 48: a
request of a higher class gets the CPU within one engine step; issue 49: out of engine.py).

A step that reads a prompt runs for seconds (512 rows of the 1.5B model on two cores: 4-6 s), and
llama.cpp calls back between its graph operations. The watch answers each call back, "give it up?":

- join: a request arrived with the step's first one (JOIN_S after an idle engine): the step is
  dropped whole and the next takes them all;
- another model's work ranks above this engine's (the CPU board, read every BOARD_CHECK_S);
- a request of a class ranked above the step's prompt is on its way to this engine (a person's
  chat while an agent's long prompt is read on the same model: it waited for the whole step).

For the last two the prompt keeps the micro-batches llama.cpp finished (engine._kept_of_prompt).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

# how often a prompt step reads the CPU board and the class counts between its graph operations (a
# read costs tens of microseconds; a step calls back hundreds of times)
BOARD_CHECK_S = 0.01


class Watched(Protocol):
    """What the watch reads of its engine at each call (the worker sets these after the engine is made)."""

    interrupt: Callable[[], bool] | None  # is a request on its way that the engine has not read yet?
    urgent: Callable[[int], bool] | None  # is one of a class ranked above this rank on its way?
    outranked: Callable[[], bool] | None  # does another model's work rank above all of this engine's?
    heartbeat: Callable[[], None] | None  # "still working", for the daemon


class StepWatch:
    def __init__(self, engine: Watched) -> None:
        self.engine = engine
        self.join_until = 0.0  # a step started before this yields to a newcomer (JOIN_S)
        self.joinable = False  # the running step may be given up for a newcomer
        self.prompt_rank: int | None = None  # the best class (priority.class_index) of the step's prompts (None: none)
        self.preempting = False  # the step is being given up for more urgent work (keep what it finished)
        self.for_newcomer = False  # ...for a more urgent request on its way to this engine
        self._checked = 0.0
        self.joins = 0  # steps given up so that requests that arrived together share one
        self.preemptions = 0  # prompt steps given up for another model's more urgent work
        self.yields = 0  # prompt steps given up for a more urgent request to this model
        self.kept = 0  # prompt tokens the given-up steps had computed and kept

    def start(self, joinable: bool, prompt_rank: int | None) -> None:
        """Before a watched step's decode."""
        self.joinable, self.prompt_rank = joinable, prompt_rank
        self.preempting = self.for_newcomer = False

    def __call__(self) -> bool:
        """Between a watched step's graph operations: tell the daemon the worker is still working
        (hundreds of prompt tokens in one step of a large model on a few cores can outlast
        LLMD_HANG_S), and say whether to give the step up (True)."""
        e = self.engine
        if e.heartbeat is not None:
            e.heartbeat()
        now = time.perf_counter()
        if now - self._checked >= BOARD_CHECK_S:
            self._checked = now
            if e.outranked is not None and e.outranked():
                self.preempting = True
                return True
            if (self.prompt_rank is not None and self.prompt_rank > 0 and e.urgent is not None
                    and e.urgent(self.prompt_rank)):
                self.preempting = self.for_newcomer = True
                return True
        return self.joinable and now < self.join_until and bool(e.interrupt and e.interrupt())

    def board_says_yield(self) -> bool:
        """Another model's work ranks above all of this engine's (read at most every BOARD_CHECK_S):
        for idle work, which yields to anything."""
        now = time.perf_counter()
        if self.engine.outranked is None or now - self._checked < BOARD_CHECK_S:
            return False
        self._checked = now
        return self.engine.outranked()

    def given_up(self) -> None:
        """Count a step given up for more urgent work."""
        if self.for_newcomer:
            self.yields += 1
        else:
            self.preemptions += 1
        self.preempting = self.for_newcomer = False

    def info(self) -> dict[str, int]:
        return {"joins": self.joins, "preemptions": self.preemptions, "yields_to_urgent": self.yields,
                "preempted_tokens_kept": self.kept}
