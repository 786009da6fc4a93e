"""Admission and placement for the llama.cpp engine: which waiting request goes next (llmd.priority),
which free slot it goes to (the one whose KV, its own or a copy of another slot's, serves most of
its prompt for the least it overwrites, or a prefix read back from the cache), and how much of
its prompt is then already computed. The engine calls `admit` at the start of each step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from concurrent.futures import Future
from typing import TYPE_CHECKING

from llmd.backends.base import ErrorEvent, Event, GenerationRequest
from llmd.backends.llamacpp.kv_copy import lost
from llmd.backends.llamacpp.prefix_cache import Hit
from llmd.backends.llamacpp.slots import Active, Slot
from llmd.errors import EngineError, LlmdError
from llmd.priority import rank as priority_rank

if TYPE_CHECKING:
    from llmd.backends.llamacpp.engine import LlamaCppEngine

log = logging.getLogger("llmd.engine")
# a run of at least this many tokens that a slot holds at other positions is moved rather than
# computed again (fill-in-the-middle only: llama-server's --cache-reuse, which llama.vscode sets to 256)
SHIFT_MIN_RUN = 64


class Admission:
    def __init__(self, engine: LlamaCppEngine) -> None:
        self.e = engine

    def next_waiting(self) -> tuple[GenerationRequest, float]:
        """The waiting request of the highest priority (llmd.priority: its class, raised as it
        waits), an editor's completion (FIM) first among equals, then the oldest."""
        e = self.e
        now = time.perf_counter()
        i = min(range(len(e.waiting)), key=lambda i: (
            priority_rank(e.waiting[i][0].priority, now - e.waiting[i][1]), e.waiting[i][0].fim is None,
            e.waiting[i][1]))
        item = e.waiting[i]
        del e.waiting[i]
        return item

    def admit(self, events: list[Event]) -> None:
        """Fill free slots: first requests whose prefix has been read from disk, then waiting ones,
        as many at once as there are free slots, so each goes to the slot that holds most of its
        prompt. A waiting request whose prefix is on disk waits for the read off the step thread,
        in `reading`, while the other slots go on."""
        e = self.e
        while self.free():
            ready = self._ready(events)
            if not ready:
                if not e.waiting:
                    return
                continue  # this group failed to prepare or went to disk reads: the next waiting ones
            holders = {id(a): self._holder(a) for a, _ in ready}
            for i, (active, hit) in enumerate(ready):
                # slots another request of this group holds more of its prompt in are left to it
                mine = holders[id(active)]
                avoid = {h for a, _ in ready[i + 1:] if (h := holders[id(a)]) is not None and h != mine}
                self._admit_one(active, hit, events, avoid)

    def _ready(self, events: list[Event]) -> list[tuple[Active, Hit | None]]:
        """A request whose prefix was read from disk, or up to as many waiting requests as there are
        free slots, prepared, with their prefix cache entries (those read from disk go to `reading`)."""
        e = self.e
        done = next((r for r in e.reading if r[1].done()), None)
        if done is not None:
            e.reading.remove(done)
            active, read = done
            return [(active, read.result() if read.exception() is None else None)]
        ready: list[tuple[Active, Hit | None]] = []
        for _ in range(min(len(self.free()), len(e.waiting))):
            req, t_received = self.next_waiting()
            try:
                active = e.preparation.prepare(req, t_received)
            except LlmdError as err:
                events.append(ErrorEvent(req.id, err.to_wire()))
                continue
            except Exception as err:  # a bug or a llama.cpp failure: fail this request, keep serving
                log.exception("preparing request %s failed", req.id)
                events.append(ErrorEvent(req.id, EngineError(f"engine failed to prepare the request: {err}").to_wire()))
                continue
            found = self._lookup(active)
            if isinstance(found, Future):
                e.reading.append((active, found))
            else:
                ready.append((active, found))
        return ready

    def _holder(self, active: Active) -> int | None:
        """The free slot whose own KV serves the most of the request's prompt, when it serves more
        than every other free slot does."""
        e = self.e
        if not active.req.cache_prompt:
            return None
        got = sorted(((e._reusable(s, active.prompt), s.seq) for s in self.free()), reverse=True)
        return got[0][1] if got and (len(got) == 1 or got[0][0] > got[1][0]) else None

    def _admit_one(self, active: Active, hit: Hit | None, events: list[Event], avoid: set[int]) -> None:
        e = self.e
        slot = None
        try:
            slot, reuse = self.place(active, hit, avoid)
            if self._shifts(active):
                # an editor's window slid down a line: the KV of the lines it kept, moved
                reuse = slot.reuse_shifted(e._L, e.mem, active.prompt, reuse, SHIFT_MIN_RUN)
            else:
                slot.truncate(e._L, e.mem, reuse)
            if not e.exact and active.req.cache_prompt:  # another slot may hold more of the prompt
                donor = e.copier.source(e.slots, slot, active.prompt, reuse, e._reusable)
                if donor is not None and e.copier.copy(e._L, e.ctx, e.mem, donor[0], slot, donor[1]):
                    reuse = donor[1]
                elif donor is not None:  # refused: the slot was emptied, its prompt is computed
                    reuse = 0
        except Exception as err:  # this request's placement failed: it is answered, no other is
            log.exception("placing request %s in a slot failed", active.req.id)
            if slot is not None:
                slot.active = active
                e.replies.fail(slot, events, f"the engine failed to place the request ({type(err).__name__}: {err}); "
                                         "the model goes on serving: retry the request")
            else:
                active.sampler.close()
                events.append(ErrorEvent(active.req.id, EngineError(
                    f"the engine failed to place the request ({type(err).__name__}: {err}); retry the request").to_wire()))
            return
        if reuse > len(active.prompt) - e.rows.last_rows:  # the prompt's last rows go with its sampling step
            reuse = max(0, len(active.prompt) - e.rows.last_rows)
            slot.truncate(e._L, e.mem, reuse)
        active.cached = active.pos = reuse
        active.t_admitted = time.perf_counter()
        slot.active = active
        slot.fim_head = active.fim_head

    def free(self) -> list[Slot]:
        e = self.e
        return [s for s in e.slots if s.active is None]

    def _lookup(self, active: Active) -> Hit | Future[Hit | None] | None:
        """The prefix cache's entry for the prompt, when it would serve more than a free slot does."""
        e = self.e
        if e.prefix is None or not active.req.cache_prompt:
            return None
        live = max((e._reusable(s, active.prompt) for s in self.free()), default=0)
        with e.profiler.span("prefix_lookup"):
            return e.prefix.lookup(active.prompt, live)

    def _shifts(self, active: Active) -> bool:
        """Whether a slot may serve this prompt with KV moved to new positions (Slot.reuse_shifted)."""
        e = self.e
        return active.req.fim is not None and active.req.cache_prompt and not e.exact and e._can_shift

    def place(self, active: Active, hit: Hit | None, avoid: Collection[int] = ()) -> tuple[Slot, int]:
        """The free slot that serves most of the prompt for the least KV it overwrites, or the one
        the prefix cache's `hit` is restored into when it serves more; and how many prompt tokens
        it serves. A slot's own KV counts, and (fast policy) a copy of what another slot holds: a
        prompt sharing only a few tokens with a slot that holds a long conversation or a shared
        system prompt goes to an emptier slot instead of overwriting it (measured: a chat with its
        own system prompt matched 5 tokens of the slot holding Qwen's default one and overwrote
        it, so four clients that came next, which share that default, all computed it again)."""
        e = self.e
        if e._place_raises and len(active.prompt) > 100:
            raise RuntimeError("test switch: a placement that fails")
        free = [s for s in self.free() if s.seq not in avoid] or self.free()
        if not active.req.cache_prompt:
            return min(free, key=lambda s: (lost(s, 0), s.last_used)), 0
        prompt = active.prompt
        reuse_of = {s.seq: e._reusable(s, prompt) for s in e.slots}
        holder = max(e.slots, key=lambda s: reuse_of[s.seq])
        best = reuse_of[holder.seq]
        # an editor's window slid down a line: the slot holding the old window serves it by moving
        # its KV (_admit_one), though it shares only the first token; chosen by its common prefix
        # alone, the request went to an emptier slot and read its 600 tokens again
        moved = ({s.seq: s.shift_serves(prompt, reuse_of[s.seq], SHIFT_MIN_RUN) for s in free}
                 if self._shifts(active) else {})

        def value(s: Slot) -> tuple[float, float]:
            r = reuse_of[s.seq]
            served = r if e.exact else e.copier.served(r, best, len(holder.tokens))
            kept = r  # what the slot keeps of its own KV: its common prefix, or what moving it serves
            if moved.get(s.seq, 0) > served:
                served = kept = moved[s.seq]
            return served - lost(s, kept), -s.last_used

        slot = max(free, key=value)
        reuse = reuse_of[slot.seq]
        if hit is None or e.prefix is None or hit.n <= max(reuse, moved.get(slot.seq, 0)):
            return slot, reuse
        # restore into the free slot whose own KV serves this prompt least, oldest first
        target = min(free, key=lambda s: (e._reusable(s, prompt), s.last_used))
        with e.profiler.span("prefix_restore"):
            if e.prefix.restore(e._L, e.ctx, e.mem, target, hit):
                return target, hit.n
        return (slot, reuse) if slot is not target else (target, 0)
