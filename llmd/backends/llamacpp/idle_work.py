"""What the llama.cpp engine does for itself when no request needs it (DESIGN: the engine's idle work):

- (fast) anticipate the next turn: prefill the template's end of turn and the next user header
  after a chat reply, so the next turn prefills only the user's words;
- (exact) re-prefill a reply's KV in whole chunks, as a prompt would be, so it is batch-independent;
- save a slot's prefix to the prefix cache (a snapshot);
- time draft verification on this machine once (speculation's cost), when every slot is free.

Each is aborted by a command arriving from the daemon or another model's request on the CPU
board (the engine's `_abort_cb`), so idle work never delays a request; what was aborted is retried
when the engine is idle again. The first three run on a thread at the OS's lowest priority
(low_priority.py), so they take only CPU time no other program wants (issue 51: after each answer
both cores stayed busy for seconds, and a program started then ran at half speed); their CPU
seconds are counted for /llmd/status. The cost measurement stays at normal priority: it is a timing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmd.backends.llamacpp.slots import Slot
from llmd.backends.low_priority import IdleThread

if TYPE_CHECKING:
    from llmd.backends.llamacpp.engine import LlamaCppEngine


class IdleWork:
    def __init__(self, engine: LlamaCppEngine) -> None:
        self.e = engine
        self.low = IdleThread("llmd-idle-work")

    def cost_pending(self) -> bool:
        """Speculation still wants its cost measured, and every slot is free for it."""
        e = self.e
        return (e.spec.want_cost and not e.spec.cost and not e.waiting and not e.reading
                and all(s.active is None for s in e.slots))

    def slot(self) -> Slot | None:
        """A free slot with work for an idle moment: (exact) a reply to re-prefill, (fast) a next
        turn to anticipate, or a snapshot for the prefix cache."""
        e = self.e
        if e.waiting or e.reading:
            return None
        if e.exact:
            for slot in e.slots:
                if slot.active is None and e.grid.reprefill_end(slot) is not None:
                    return slot
        else:
            for slot in e.slots:
                if slot.active is None and slot.tail:
                    return slot
        if e.prefix is not None:
            for slot in e.slots:
                if slot.active is None and e.prefix.wants(slot):
                    return slot
        return None

    def work(self) -> None:
        """One piece of idle work, if there is any."""
        e = self.e
        slot = self.slot()
        if slot is not None and not e.waiting:
            self.low.run(self._work_on, slot)
        elif self.cost_pending():
            self._measure_cost()

    def _work_on(self, slot: Slot) -> None:
        e = self.e
        if e.exact and e.grid.reprefill_end(slot) is not None:
            self._reprefill_chunk(slot)
        elif not e.exact and slot.tail:
            self._anticipate(slot)
        elif e.prefix is not None:
            with e.profiler.span("prefix_save"):
                e.prefix.save(e._L, e.ctx, e.mem, slot)

    def stats(self, answers: int) -> dict[str, object]:
        """CPU seconds of idle work, in all and per answer, and the priority it runs at."""
        return {"cpu_s": round(self.low.cpu_s, 2), "runs": self.low.runs, "priority": self.low.priority,
                "cpu_s_per_answer": round(self.low.cpu_s / answers, 3) if answers else None}

    def close(self) -> None:
        self.low.close()

    def _reprefill_chunk(self, slot: Slot) -> None:
        """(exact) Recompute one whole chunk past `exact` as prefill would, dropping decode-time KV."""
        e = self.e
        end = e.grid.reprefill_end(slot)
        assert end is not None
        start = slot.exact
        L = e._L
        if len(slot.tokens) > start:  # decode-time KV past `exact`: drop it, keep its tokens to redo
            slot.tail[:0] = slot.tokens[start:]
            del slot.tokens[start:]
            L.llama_memory_seq_rm(e.mem, slot.seq, start, -1)
        chunk = slot.tail[: end - start]
        if not self._run_abortable(slot, chunk, start):  # aborted (or failed): the tail stays, retried when idle again
            L.llama_memory_seq_rm(e.mem, slot.seq, start, -1)
            return
        slot.tokens.extend(chunk)
        del slot.tail[: end - start]
        slot.exact = end

    def _anticipate(self, slot: Slot) -> None:
        """(fast) Prefill the template's end of turn and next user header after a chat reply."""
        e = self.e
        chunk, start = slot.tail, len(slot.tokens)
        slot.tail = []
        if self._run_abortable(slot, chunk, start):
            slot.tokens.extend(chunk)
        else:
            e._L.llama_memory_seq_rm(e.mem, slot.seq, start, -1)

    def _run_abortable(self, slot: Slot, tokens: list[int], start: int) -> bool:
        """A decode that a command arriving from the daemon aborts (False)."""
        e = self.e
        L = e._L
        L.llama_set_abort_callback(e.ctx, e._abort_cb, None)
        try:
            return e._run(slot, tokens, start, logits_last=False)
        finally:
            L.llama_set_abort_callback(e.ctx, L.ggml_abort_callback(), None)

    def _measure_cost(self) -> None:
        """Time verifying k drafts on this machine, in an idle slot (when every slot is free); its
        cached prefix is given up once, for this measurement."""
        e = self.e
        L = e._L
        scratch = e.slots[-1]
        scratch.forget(L, e.mem)
        e._threads_for(1)  # verification batches are small: timed with the decode thread count
        L.llama_set_abort_callback(e.ctx, e._abort_cb, None)
        try:
            e.spec.measure_cost(e._llama_decode, e.batch, e.mem, scratch.seq,
                                e.bos if e.bos >= 0 else 0, lambda: bool(e.interrupt and e.interrupt()))
        finally:
            L.llama_set_abort_callback(e.ctx, L.ggml_abort_callback(), None)
            scratch.forget(L, e.mem)
