"""How many threads llama.cpp uses, chosen from what other programs use (DESIGN: A busy machine).

llama.cpp's threads meet at a barrier after every operation of a decode. When another program
holds a core, the thread that runs there is preempted and every other thread spins at the next
barrier until it gets the core back: measured on two cores with one busy elsewhere, decoding with
two threads ran 35x slower than with one. So while the engine works, every CHECK_S it reads how
much CPU time the machine spent outside this process since the last check (psutil: the system's
busy time minus llmd's own) and gives up one thread for every core that others keep
busy. It takes a thread back only after two quiet checks in a row, so a short burst elsewhere
does not flap the count. A window never spans time the engine was not working (the engine says
when each step is done): what other programs did while llmd waited (another server's turn in a
benchmark, a build that has ended) says nothing about contention with llmd's own threads, and a
window holding a peer's 0.3 s burst between two short chats once put every short chat on one
thread, at twice the time to first token. After an idle spell of IDLE_S it also starts again at
the full count. Reading two counters four times a second costs nothing measurable.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import psutil

log = logging.getLogger("llmd.threads")

CHECK_S = 0.25  # how often the count is reconsidered while the engine works
TAKEN = 0.4  # a core others keep busy at least this much (in cores) costs one thread
QUIET_CHECKS = 2  # checks in a row that allow more threads before the count goes up
LOG_EVERY_S = 10.0  # at most one log line about a change per this many seconds
# Longer than this since the last check, the engine was idle: the window then mostly holds what
# happened before the request (a build that has ended, another server's turn in a benchmark), so
# the first check after idle starts a new window at the full count instead of deciding on the old.
IDLE_S = 1.0
# More than this between the end of one step and the start of the next: the engine waited (for a
# request, a command) rather than worked, and the window starts again at this step. Back-to-back
# steps are a few milliseconds apart (the worker relays events and polls its pipe in between).
IDLE_GAP_S = 0.05


@dataclass
class _Sample:
    wall: float
    busy: float  # the machine's CPU-seconds not idle, all cores
    own: float  # this process's CPU-seconds


class ThreadGovernor:
    """The thread count for the engine's contexts: `fixed` (a reason, such as LLMD_THREADS) keeps
    `most` always."""

    def __init__(self, most: int, fixed: str = "") -> None:
        self.most = max(1, most)
        self.fixed = bool(fixed)
        self.threads = self.most
        self.others = 0.0  # cores other programs kept busy over the last check
        self.reason = (f"fixed at {self.most} ({fixed})" if fixed
                       else f"{self.most} of {self.most}: the machine is quiet")
        self.changes = 0
        # llmd's own processes: this worker, the daemon that relays its tokens (its short bursts
        # come with the worker's steps, not against them) and the other models' workers, which the
        # CPU board (backends/cpu_board.py) shares the cores with, rather than this count
        me = psutil.Process()
        self._me, self._daemon = me, me.parent()
        self._last = self._sample() if not self.fixed else None
        self._quiet = 0
        self._logged = 0.0
        self._done_at: float | None = None  # when the last step ended

    def done(self) -> None:
        """The engine finished a step (called after each)."""
        self._done_at = time.perf_counter()

    def check(self) -> int | None:
        """The new thread count when it should change now, else None. Called before each step."""
        if self.fixed:
            return None
        now = time.perf_counter()
        if self._done_at is not None and now - self._done_at > IDLE_GAP_S:
            waited, self._done_at = now - self._done_at, None
            self._last, self._quiet = self._sample(now), 0  # the window starts with this step
            if waited > IDLE_S and self.threads != self.most:
                self.threads, self.reason = self.most, f"{self.most} of {self.most}: back from idle, measuring again"
                return self.most
            return None
        last = self._last
        assert last is not None
        if now - last.wall < CHECK_S:
            return None
        cur = self._sample(now)
        self._last = cur
        wall = cur.wall - last.wall
        if wall > IDLE_S:
            self._quiet = 0
            if self.threads == self.most:
                return None
            self.threads, self.reason = self.most, f"{self.most} of {self.most}: back from idle, measuring again"
            return self.most
        self.others = max(0.0, (cur.busy - last.busy) - (cur.own - last.own)) / wall
        want = max(1, self.most - max(0, math.ceil(self.others - TAKEN)))
        if want > self.threads:
            self._quiet += 1
            if self._quiet < QUIET_CHECKS:
                return None
        self._quiet = 0
        self.reason = self._why(want)
        if want == self.threads:
            return None
        old, self.threads = self.threads, want
        self.changes += 1
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.info("llama.cpp threads %d -> %d: %s", old, want, self.reason)
        return want

    def info(self) -> dict[str, object]:
        return {"threads": self.threads, "most": self.most, "auto": not self.fixed,
                "others_cores": round(self.others, 2), "reason": self.reason, "changes": self.changes}

    def _why(self, want: int) -> str:
        cores = psutil.cpu_count() or self.most
        if want == self.most:
            return f"{want} of {self.most}: other programs use {self.others:.1f} of {cores} cores"
        return (f"{want} of {self.most}: other programs keep {self.others:.1f} of {cores} cores busy "
                "(a preempted thread would stall the others at every barrier)")

    def _sample(self, now: float | None = None) -> _Sample:
        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        own = 0.0
        procs = [self._me]
        if self._daemon is not None:
            try:
                procs += [self._daemon, *(c for c in self._daemon.children() if c.pid != self._me.pid)]
            except psutil.Error:
                pass
        for p in procs:
            try:
                c = p.cpu_times()
                own += c.user + c.system
            except psutil.Error:  # the daemon went away: the worker is about to end too
                pass
        return _Sample(now if now is not None else time.perf_counter(), busy, own)
