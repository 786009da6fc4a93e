"""One CPU for every loaded model (issue 48, DESIGN: Several apps, several models).

Each model runs in its own worker process, and each would run llama.cpp on every core: two workers
decoding at once on two cores each spin at every graph barrier while the other holds a core, and a
person's autocomplete waits behind another app's long prompt on another model. The board is a
little shared memory the daemon creates and every worker gets a row of. Before each step a worker
writes the most urgent work it holds (its class, whether it is fill-in-the-middle, since when it
waits: llmd.priority's order) and reads the others':

- a worker whose best work ranks below another's pauses (no step; it keeps reading its pipe and
  sending heartbeats) until the other's work is done or its own has waited long enough to rank level
  (priority.AGING_S per class, so nothing is starved);
- workers whose best work ranks level split the cores between them (`share`) instead of each
  running every thread against the others;
- a worker with only its own idle work (anticipation, snapshots) pauses while any other works.

A row not written for STALE_S is ignored (a worker stopped by a signal or inside something that
cannot write), and the daemon clears a row when its worker exits, so a dead worker pauses nobody.
Clocks: time.perf_counter is CLOCK_MONOTONIC on Linux, the same in every process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from typing import Any

from llmd.priority import CLASSES, rank

ROWS = 32  # workers at once (models, standbys); a worker with no row runs unboarded, as before
FIELDS = 4  # class index (or NaN: nothing), fim (1.0/0.0), waiting since, written at
STALE_S = 5.0


@dataclass(frozen=True)
class Claim:
    """The most urgent work a worker holds."""

    cls: str
    fim: bool
    since: float  # perf_counter when it arrived

    def key(self, now: float) -> tuple[int, bool]:
        """What orders workers: the rank (aged) and, among equals, an editor's completion first.
        Not the arrival time: level workers share the cores rather than take turns."""
        return rank(self.cls, now - self.since), not self.fim


@dataclass(frozen=True)
class Verdict:
    pause: bool  # another worker's work ranks above all of this one's
    share: int  # threads this worker may use beside those it ranks level with
    others: int  # other workers with work now
    why: str


class CpuBoard:
    """The shared rows. Made in the daemon, handed to each worker process at its start."""

    def __init__(self, rows: int = ROWS) -> None:
        self.rows = rows
        self._arr: Any = mp.get_context("spawn").RawArray("d", rows * FIELDS)
        self._free = list(range(rows))
        self._lock = threading.Lock()
        for r in range(rows):
            self.clear(r)

    def __getstate__(self) -> dict[str, Any]:  # to a worker: the shared rows, not the daemon's free list
        return {"rows": self.rows, "_arr": self._arr}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._free, self._lock = [], threading.Lock()

    # ---- the daemon's side ----------------------------------------------------------------------

    def take(self) -> int | None:
        with self._lock:
            return self._free.pop(0) if self._free else None

    def give_back(self, row: int) -> None:
        self.clear(row)
        with self._lock:
            if row not in self._free:
                self._free.append(row)

    # ---- a worker's side ------------------------------------------------------------------------

    def clear(self, row: int) -> None:
        self._arr[row * FIELDS] = math.nan

    def publish(self, row: int, claim: Claim | None, now: float | None = None) -> None:
        i = row * FIELDS
        a = self._arr
        if claim is None:
            a[i] = math.nan
            return
        a[i + 1] = 1.0 if claim.fim else 0.0
        a[i + 2] = claim.since
        a[i + 3] = time.perf_counter() if now is None else now
        a[i] = float(CLASSES.index(claim.cls))  # last: a reader never sees a class without its fields

    def claims(self, now: float, but: int | None = None) -> list[Claim]:
        """The live claims of every row but `but`."""
        out = []
        a = self._arr
        for r in range(self.rows):
            if r == but:
                continue
            i = r * FIELDS
            c = a[i]
            if math.isnan(c) or now - a[i + 3] > STALE_S or not 0 <= int(c) < len(CLASSES):
                continue
            out.append(Claim(CLASSES[int(c)], a[i + 1] > 0.5, a[i + 2]))
        return out

    def verdict(self, row: int, mine: Claim | None, most: int, now: float | None = None) -> Verdict:
        """Whether the worker in `row` should step now, and on how many threads."""
        now = time.perf_counter() if now is None else now
        others = self.claims(now, but=row)
        if not others:
            return Verdict(False, most, 0, "")
        best = min(c.key(now) for c in others)
        if mine is None:
            return Verdict(True, most, len(others), "only idle work, and another model has requests")
        key = mine.key(now)
        if best < key:
            top = min(others, key=lambda c: c.key(now))
            return Verdict(True, most, len(others), f"another model serves {'an editor' if top.fim else top.cls} work first")
        level = 1 + sum(1 for c in others if c.key(now) == key)
        share = max(1, most // level)
        return Verdict(False, share, len(others),
                       f"{share} of {most} threads beside {level - 1} other model(s) at the same priority" if level > 1 else "")


_board: CpuBoard | None = None


def board() -> CpuBoard:
    """The daemon's board (made on first use, before any worker starts)."""
    global _board
    if _board is None:
        _board = CpuBoard()
    return _board
