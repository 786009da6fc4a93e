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

Another model's work does not cost the step, though: the watch holds it where it is (`_hold`: the
call back sleeps, llama.cpp's other threads wait at their barrier, asleep after OpenMP's spin)
until that work is done, and the step goes on from the same graph operation. Given up, each step
lost the micro-batch it was in: 86 steps of the agent's prompt beside an editor's completions in a
326-s desktop run, about 100 of the 1.5B's 460 CPU-seconds. A hold longer than HOLD_MAX_S gives the
step up as before (the minimum share's turns are decided between steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

# how often a prompt step reads the CPU board and the class counts between its graph operations (a
# read costs tens of microseconds; a step calls back hundreds of times)
BOARD_CHECK_S = 0.01
HOLD_POLL_S = 0.005  # how often a held step reads the board (an editor's completion takes 0.1-1 s)
HOLD_MAX_S = 5.0  # a held step is given up past this: about the minimum share's wait for a turn (cpu_board.Turns)


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
        self.holds = 0  # steps held for another model's work, then gone on with
        self.held_s = 0.0  # the time they were held, in all
        self.step_held_s = 0.0  # the running step's held time (not its compute: engine rates leave it out)

    def start(self, joinable: bool, prompt_rank: int | None) -> None:
        """Before a watched step's decode."""
        self.joinable, self.prompt_rank = joinable, prompt_rank
        self.preempting = self.for_newcomer = False
        self.step_held_s = 0.0

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
                cleared = self._hold()
                self._checked = time.perf_counter()
                if cleared:
                    return False
                self.preempting = True
                return True
            if self._newcomer_above():
                self.preempting = self.for_newcomer = True
                return True
        return self.joinable and now < self.join_until and bool(e.interrupt and e.interrupt())

    def _newcomer_above(self) -> bool:
        """A request of a class ranked above the step's prompts is on its way to this engine."""
        e = self.engine
        return (self.prompt_rank is not None and self.prompt_rank > 0 and e.urgent is not None
                and e.urgent(self.prompt_rank))

    def _hold(self) -> bool:
        """Wait inside the step while another model's work ranks above all of this engine's: True
        when that work is done (the step goes on), False when the step is to be given up (held past
        HOLD_MAX_S, or a request ranked above its prompts came to this engine, which needs the step
        out of the way; then `for_newcomer` says so)."""
        e = self.engine
        t0 = time.perf_counter()
        try:
            while time.perf_counter() - t0 < HOLD_MAX_S:
                time.sleep(HOLD_POLL_S)
                if e.heartbeat is not None:
                    e.heartbeat()
                if self._newcomer_above():
                    self.for_newcomer = True
                    return False
                if e.outranked is None or not e.outranked():
                    self.holds += 1
                    return True
            return False
        finally:
            self.step_held_s += time.perf_counter() - t0
            self.held_s += time.perf_counter() - t0

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

    def info(self) -> dict[str, int | float]:
        return {"joins": self.joins, "preemptions": self.preemptions, "yields_to_urgent": self.yields,
                "preempted_tokens_kept": self.kept, "holds": self.holds, "held_s": round(self.held_s, 1)}
