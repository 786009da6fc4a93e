"""Copying a prompt's shared prefix from one slot's KV to another instead of computing it again.

Requests often share a beginning: a system prompt (a model's default one included), an agent's
instructions, a document asked about twice. The slot a request lands in may not hold it while
another slot does: several requests arrive together and only one can take the slot that holds
it, or that slot is busy. With one KV stream per slot, llama.cpp copies a whole stream at the
next decode (every cell, used or not: the slot's context x bytes per token), so the copy costs
the same whatever the prefix's length, while computing the prefix costs each of its tokens'
prefill. The copy is made only where it is the cheaper of the two, with the prefill cost per
token measured on this machine and model (it moves: a 135M model prefills 2,000 tokens/s on two
cores, a 1.5B model 160), and only under the fast policy (exact reuses prefill-computed chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llmd.backends.llamacpp.slots import Slot

# memcpy on the machines measured (2 cores, shared): 7 GB/s; taken lower so a copy's cost is not
# underestimated while the machine is busy
COPY_BYTES_PER_S = 4e9
PAYS = 1.5  # the prefill it saves must cost this many times the copy's estimate


def lost(slot: Slot, reuse: int) -> int:
    """Tokens of `slot`'s KV that a request served `reuse` tokens by it would overwrite and that
    nothing else keeps (the prefix cache holds the first `saved`)."""
    return max(0, len(slot.tokens) - max(reuse, slot.saved))


class PrefixCopier:
    def __init__(self, stream_bytes: int, prefill_token_s: float) -> None:
        self.copy_s = stream_bytes / COPY_BYTES_PER_S
        self.prefill_token_s = prefill_token_s  # seconds per prefilled token; kept up to date by observe
        self.copies = 0
        self.tokens = 0  # prompt tokens served by copies instead of prefill
        # copies llama.cpp has queued and not applied yet (it applies them at the next decode): their
        # sources must not change before then (a restore or a truncation would be what gets copied),
        # and their targets do not hold the copied KV yet, so they cannot be copied from
        self._sources: set[int] = set()
        self._targets: set[int] = set()
        self._queued_at = -1  # the decoder's call count when they were queued

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that prefilled `tokens` and decoded nothing else took `seconds`."""
        if tokens >= 32:
            self.prefill_token_s = 0.8 * self.prefill_token_s + 0.2 * seconds / tokens

    def pays(self, tokens: int) -> bool:
        return tokens * self.prefill_token_s > PAYS * self.copy_s

    def served(self, reuse: int, best: int) -> float:
        """Prompt tokens a slot holding `reuse` of them serves when another slot holds `best`: a
        copy's, less the copy's cost counted in prefill tokens, where the copy pays."""
        if self.pays(best - reuse):
            return best - self.copy_s / self.prefill_token_s
        return reuse

    def _queued(self, decodes: int) -> None:
        if decodes != self._queued_at:  # a decode ran since: every queued copy is applied
            self._sources.clear()
            self._targets.clear()
            self._queued_at = decodes

    def held(self, slot: Slot, decodes: int) -> bool:
        """Whether `slot` is the source of a copy not applied yet: nothing may be written to it (a
        prefix restore, a truncation, a shift) until the next decode has copied it."""
        self._queued(decodes)
        return slot.seq in self._sources

    def source(self, slots: Sequence[Slot], target: Slot, prompt: list[int], reuse: int,
               reusable: Callable[[Slot, list[int]], int], decodes: int = -1) -> tuple[Slot, int] | None:
        """The slot whose KV serves most of `prompt`, and how much, when copying it into `target`
        (which serves `reuse` tokens itself) pays; None when it does not. A slot whose own copy is
        still queued holds the tokens it will have, not their KV yet: never a source."""
        self._queued(decodes)
        best = max(((s, reusable(s, prompt)) for s in slots if s is not target and s.seq not in self._targets),
                   key=lambda x: x[1], default=None)
        if best is None or not self.pays(best[1] - reuse):
            return None
        return best

    def copy(self, L: Any, mem: Any, src: Slot, dst: Slot, n: int, decodes: int = -1) -> None:
        """Make `dst` hold the first n tokens of `src`. llama.cpp copies the stream at the next
        decode, before that batch writes anything: `src`'s cells up to n are what it holds now,
        and stay so (held) until that decode."""
        self._queued(decodes)
        self._sources.add(src.seq)
        self._targets.add(dst.seq)
        dst.forget(L, mem)
        L.llama_memory_seq_cp(mem, src.seq, dst.seq, -1, -1)  # across streams: whole streams only
        L.llama_memory_seq_rm(mem, dst.seq, n, -1)
        dst.tokens = src.tokens[:n]
        dst.saved = min(src.saved, n)  # the same tokens: what the prefix cache holds of them
        self.copies += 1
        self.tokens += n

    def info(self) -> dict[str, Any]:
        return {"copies": self.copies, "tokens": self.tokens, "copy_ms": round(self.copy_s * 1000, 1),
                "prefill_token_ms": round(self.prefill_token_s * 1000, 3)}
