"""One CPU for every loaded model (issue 48, DESIGN: Several apps, several models).

Each model runs in its own worker process, and each would run llama.cpp on every core: two workers
decoding at once on two cores each spin at every graph barrier while the other holds a core, and a
person's autocomplete waits behind another app's long prompt on another model. The board is a
little shared memory the daemon creates and every worker gets a row of. Before each step a worker
writes the most urgent work it holds (its class, whether it is fill-in-the-middle, since when it
waits: llmd.priority's order) and reads the others':

- a worker whose best work ranks below another's pauses (no step; it keeps reading its pipe and
  sending heartbeats) until the other's work is done or its own has waited long enough to rank level
  (priority.AGING_S per class), up to the agent class: beside a person's requests what it is owed
  comes in turns (below), not by ranking level with them (`board_rank`);
- workers whose best work ranks level split the cores between them (`share`) instead of each
  running every thread against the others;
- a worker with only its own idle work (anticipation, snapshots) pauses while any other works;
- a worker held back takes a short turn now and then (`Turns`), so a lower class keeps a minimum
  share of the CPU (LLMD_MIN_SHARE) while a person types: ranking alone let an agent's prompt
  run one step in 40 s while an editor's completions kept coming (1 turn of an agent's 15 in
  benchmarks/desktop.py). A claim on its turn pauses nobody; it splits the cores with the others.
  Background work takes a quarter of that share (`turn_share`);
- a worker held back lately reads its prompt in short steps even on its own time (CONTENDED_S), so
  the step it gives up for the next completion loses little.

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

from llmd.priority import CLASSES, class_index, rank

ROWS = 32  # workers at once (models, standbys); a worker with no row runs unboarded, as before
FIELDS = 5  # class index (or NaN: nothing), fim (1.0/0.0), waiting since, written at, on its turn (1.0/0.0)
STALE_S = 5.0
# An editor's completion goes ahead of same-class work on another model for this long of that
# work's wait, then they split the cores: with the lead unbounded a person's chat beside someone
# typing waited for aging to raise it (chat p90 25 s against 0.53 s alone in benchmarks/desktop.py)
FIM_LEAD_S = 1.0
TURN_ROWS = 64  # a prompt's rows in a held-back worker's turn (Turns): about 1 s of the 1.5B on one thread
# A worker held back in the last CONTENDED_S reads its prompt TURN_ROWS a step even on its own
# time: a step given up for another model's more urgent work loses the micro-batch it was in, and
# beside an editor's completions every 3-4 s an agent's 512-row steps (about 6 s of the 1.5B on two
# cores) were given up 3 to 5 times each before one finished (0 turns of the agent's 13 alone in
# benchmarks/desktop.py). 64-row micro-batches read the 1.5B at 70 tok/s against 72-74 for 512
# (llama-bench, AMD EPYC, 2 threads, 2,048 deep).
CONTENDED_S = 10.0


# Background work held back takes this fraction of the minimum share (LLMD_MIN_SHARE) in turns:
# at the full share an indexer's embeddings took 53 of 395 CPU-seconds beside an agent's prompt and a
# chat (benchmarks/desktop.py), the agent, a class above, missed its first turn by about 11, and each
# turn split the cores under the chat. With none at all a background prompt beside an editor's steady
# completions waited for aging alone (a step per 40 s: 353 s for 2,000 tokens).
BACKGROUND_TURNS = 0.25


# Across models a waiting request rises up to the agent class, never to a person's: ranked level, an
# indexer's batch aged 40 s split the cores under a person's chat (its 14-token prompt on one
# thread: 0.77 s; first token 0.79 s against 0.33 s) and, being older, went ahead of it for the
# chat's first second (FIM_LEAD_S). Turns give held-back work its share instead; with
# LLMD_MIN_SHARE=0 work runs strictly by class, as that setting says.
RISES_TO = CLASSES.index("agent")


def board_rank(cls: str, waited_s: float) -> int:
    """llmd.priority's rank, aged, but not above the agent class for a class below it."""
    return max(rank(cls, waited_s), min(class_index(cls), RISES_TO))


def turn_share(cls: str) -> float:
    """The fraction of the minimum share work of this class takes in turns while held back."""
    return BACKGROUND_TURNS if cls == "background" else 1.0


@dataclass(frozen=True)
class Claim:
    """The most urgent work a worker holds."""

    cls: str
    fim: bool
    since: float  # perf_counter when it arrived
    turn: bool = False  # held back, it takes its turn now (Turns): it pauses nobody and shares the cores

    def key(self, now: float) -> tuple[int, bool]:
        """What orders workers: the rank (aged) and, among equals, an editor's completion first, for
        the first FIM_LEAD_S of the other work's wait; then they are level. Not the arrival time:
        level workers share the cores rather than take turns."""
        return board_rank(self.cls, now - self.since), not self.fim and now - self.since < FIM_LEAD_S


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
        a[i + 4] = 1.0 if claim.turn else 0.0
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
            out.append(Claim(CLASSES[int(c)], a[i + 1] > 0.5, a[i + 2], a[i + 4] > 0.5))
        return out

    def turn_taken(self, row: int, now: float | None = None) -> bool:
        """Another worker is on its turn: one at a time, or three workers would run on two cores
        (every graph barrier of each then waits for a thread the others hold)."""
        return any(c.turn for c in self.claims(time.perf_counter() if now is None else now, but=row))

    def verdict(self, row: int, mine: Claim | None, most: int, now: float | None = None) -> Verdict:
        """Whether the worker in `row` should step now, and on how many threads."""
        now = time.perf_counter() if now is None else now
        others = self.claims(now, but=row)
        if not others:
            return Verdict(False, most, 0, "")
        if mine is None:
            return Verdict(True, most, len(others), "only idle work, and another model has requests")
        if mine.turn:  # its share while others rank above it: beside all of them
            share = max(1, most // (1 + len(others)))
            return Verdict(False, share, len(others), f"a turn of {mine.cls} work on {share} of {most} threads "
                                                      "(the minimum share of a class held back)")
        key = mine.key(now)
        ranked = [c for c in others if not c.turn]
        if ranked and min(c.key(now) for c in ranked) < key:
            top = min(ranked, key=lambda c: c.key(now))
            return Verdict(True, most, len(others), f"another model serves {'an editor' if top.fim else top.cls} work first")
        # workers at the same rank split the cores, and so does one on its turn
        level = 1 + sum(1 for c in others if c.turn or c.key(now) == key)
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


class Turns:
    """A held-back worker's minimum share (LLMD_MIN_SHARE): once it has waited long enough that a
    turn as long as its last keeps it at `share` of the time, its next step is a turn (a short one:
    the engine takes at most TURN_ROWS of a prompt), then it waits again. Waiting starts when it is
    first held back and ends whenever it runs in its own right."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.held_since: float | None = None
        self.last_turn_s = 0.5  # a first guess of a turn's length; each turn is timed
        self.on = False
        self._started = 0.0
        self.turns = 0
        self.held = 0  # times another model's work held this one back (a pause between steps)
        self.last_held = -math.inf  # when another model's work last held this one back

    def due(self, held: bool, now: float, taken: bool = False, scale: float = 1.0) -> bool:
        """Called before each step with whether the board holds this worker back (and whether
        another worker is on its turn now: then this one's waits until that ends; `scale`: the
        fraction of the share its work's class takes, turn_share): True when this step is its turn."""
        if self.on:  # the last step was a turn: time it, and wait anew
            self.on = False
            self.last_turn_s = max(0.01, now - self._started)
            self.held_since = now
        if not held:
            self.held_since = None
            return False
        self.last_held = now
        if self.held_since is None:
            self.held_since = now
            self.held += 1
        share = self.share * scale
        if share <= 0:
            return False
        wait = self.last_turn_s * (1 - share) / share
        if now - self.held_since < wait or taken:
            return False
        self.on, self._started = True, now
        self.turns += 1
        return True

    def step_rows(self, now: float) -> int | None:
        """The most rows of a prompt the next step reads (None: as many as the engine would): a
        turn's, and as many while other models' work held this one back lately (CONTENDED_S)."""
        return TURN_ROWS if self.on or now - self.last_held < CONTENDED_S else None
