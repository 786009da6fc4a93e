"""Copying a prompt's shared prefix from one slot's KV to another instead of computing it again.

Requests often share a beginning: a system prompt (a model's default one included), an agent's
instructions, a document asked about twice. The slot a request lands in may not hold it while
another slot does: several requests arrive together and only one can take the slot that holds
it, or that slot is busy, or it holds a conversation worth keeping. The copy goes through the
sequence state (`llama_state_seq_get_data` / `set_data`, as the prefix cache restores), which
holds only the source's used cells and is written at once. llama.cpp's own `llama_memory_seq_cp`
between streams copies the whole stream at the next decode, every cell used or not: with the
automatic context (32,768 tokens a slot on Qwen2.5-Coder 1.5B, 940 MB a stream) that was estimated at
0.24 s for any prefix, so a 19-token system prompt was computed again rather than copied (short chat
TTFT 1.4x llama-server's in its first rounds), and the deferred copy read whatever a restore or
a truncation wrote to the source before that decode. The copy is made only where it is the
cheaper of the two, with the prefill cost per token measured on this machine and model (a 135M
model prefills 2,000 tokens/s on two cores, a 1.5B model 160), and only under the fast policy
(exact reuses prefill-computed chunks).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmd.backends.llamacpp.slots import Slot

# a copy's whole round trip (the buffer, the state out, the state in), measured on the 1.5B model
# on two shared cores: 0.3-0.9 ms for 20 tokens, 1.3-4.5 ms for 200, 43-51 ms for 2,000 (57 MB):
# 1.2 GB/s, taken lower so a copy's cost is not underestimated while the machine is busy
COPY_BYTES_PER_S = 1e9
COPY_FIXED_S = 0.0005
PAYS = 1.5  # the prefill it saves must cost this many times the copy's estimate


def lost(slot: Slot, reuse: int) -> int:
    """Tokens of `slot`'s KV that a request served `reuse` tokens by it would overwrite and that
    nothing else keeps (the prefix cache holds the first `saved`)."""
    return max(0, len(slot.tokens) - max(reuse, slot.saved))


class PrefixCopier:
    def __init__(self, kv_token_bytes: int, prefill_token_s: float) -> None:
        self.kv_token_bytes = kv_token_bytes
        self.prefill_token_s = prefill_token_s  # seconds per prefilled token; kept up to date by observe
        self.copies = 0
        self.tokens = 0  # prompt tokens served by copies instead of prefill
        self.copied_s = 0.0  # time the copies took

    def copy_s(self, src_tokens: int) -> float:
        """A copy's estimated cost: the source's whole state (all its tokens) out and in again."""
        return COPY_FIXED_S + src_tokens * self.kv_token_bytes / COPY_BYTES_PER_S

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that prefilled `tokens` and decoded nothing else took `seconds`."""
        if tokens >= 32:
            self.prefill_token_s = 0.8 * self.prefill_token_s + 0.2 * seconds / tokens

    def pays(self, tokens: int, src_tokens: int) -> bool:
        return tokens * self.prefill_token_s > PAYS * self.copy_s(src_tokens)

    def served(self, reuse: int, best: int, src_tokens: int) -> float:
        """Prompt tokens a slot holding `reuse` of them serves when another slot, holding
        `src_tokens` in all, holds `best`: a copy's, less the copy's cost counted in prefill
        tokens, where the copy pays."""
        if self.pays(best - reuse, src_tokens):
            return best - self.copy_s(src_tokens) / self.prefill_token_s
        return reuse

    def source(self, slots: Sequence[Slot], target: Slot, prompt: list[int], reuse: int,
               reusable: Callable[[Slot, list[int]], int]) -> tuple[Slot, int] | None:
        """The slot whose KV serves most of `prompt`, and how much, when copying it into `target`
        (which serves `reuse` tokens itself) pays; None when it does not."""
        best = max(((s, reusable(s, prompt)) for s in slots if s is not target and not s.shift_pending), key=lambda x: x[1],
                   default=None)
        if best is None or not self.pays(best[1] - reuse, len(best[0].tokens)):
            return None
        return best

    def copy(self, L: Any, ctx: Any, mem: Any, src: Slot, dst: Slot, n: int) -> bool:
        """Make `dst` hold the first n tokens of `src`, now. False (dst emptied) when llama.cpp
        refuses the state; the request then computes its prompt."""
        t0 = time.perf_counter()
        size = L.llama_state_seq_get_size(ctx, src.seq)
        buf = (ctypes.c_uint8 * size)()
        got = L.llama_state_seq_get_data(ctx, buf, size, src.seq)
        dst.forget(L, mem)
        if not got or not L.llama_state_seq_set_data(ctx, buf, got, dst.seq):
            dst.forget(L, mem)
            return False
        L.llama_memory_seq_rm(mem, dst.seq, n, -1)
        dst.tokens = src.tokens[:n]
        dst.saved = min(src.saved, n)  # the same tokens: what the prefix cache holds of them
        self.copies += 1
        self.tokens += n
        self.copied_s += time.perf_counter() - t0
        return True

    def info(self) -> dict[str, Any]:
        return {"copies": self.copies, "tokens": self.tokens,
                "copy_ms_mean": round(self.copied_s / self.copies * 1000, 2) if self.copies else None,
                "prefill_token_ms": round(self.prefill_token_s * 1000, 3)}
