"""Slot and request state for the llama.cpp step loop.

A slot is one sequence id in the shared context. It remembers which tokens its KV holds, how
many of them were computed by aligned prefill chunks (`exact`, used only by the exact policy:
decode-time KV differs slightly from what prefill computes, DESIGN: Two batching policies) and
how many are stored in the prefix cache (`saved`). Its operations keep those invariants
(exact <= len(tokens), saved <= len(tokens)) in one place: `truncate` and `forget` also drop
the KV from llama.cpp's memory.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmd.backends.base import GenerationRequest
from llmd.backends.llamacpp.sampler import SamplerChain
from llmd.backends.llamacpp.text import TextStream


@dataclass
class Active:
    """A request admitted into a slot."""

    req: GenerationRequest
    prompt: list[int]
    max_tokens: int
    sampler: SamplerChain
    text: TextStream
    t_received: float
    n_ctx: int = 0  # the context this request may use (the slot's, or its own smaller bound)
    cached: int = 0
    t_admitted: float = 0.0
    pos: int = 0  # next prompt index to prefill
    pending: int | None = None  # sampled token not yet decoded into the KV
    n_gen: int = 0
    t_first: float = 0.0
    t_last: float = 0.0
    t_prefill_done: float = 0.0
    t_progress: float = 0.0  # the end of the last step that computed any of it (its wait, for priority)
    cancelled: bool = False
    drafters: tuple[str, ...] = ()  # which may draft for it: "ngram", "draft" (the draft model)
    auto: bool = False  # speculation "auto": the engine decides whether drafting pays
    accept_ema: dict[str, float] = field(default_factory=dict)  # per drafter: recent share accepted
    last_drafter: str = ""  # who drafted this step ("" = nobody)
    steps_without_draft: int = 0
    drafted: int = 0
    accepted: int = 0
    logprobs: list[Any] = field(default_factory=list)  # sampled since the last event, when asked for
    dropped: int = 0  # old messages left out to fit (req.drop_old_messages)
    told: bool = False  # text has gone out (its first event carries `dropped`)
    proposing: bool = False  # past the reply's max_tokens, decoding on for the proposal (req.propose_tokens)
    heal: bytes = b""  # FIM: the text the first tokens must spell, not shown (backends/llamacpp/healing.py)
    fim_head: tuple[str, str, tuple[tuple[str, str], ...]] | None = None  # FIM: what comes before its middle (Slot)

    def first_news(self) -> int:
        """`dropped` on the request's first event, 0 after."""
        told, self.told = self.told, True
        return 0 if told else self.dropped

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)


def common_prefix(a: list[int], b: list[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds, in order
    exact: int = 0  # tokens[:exact] came from aligned prefill chunks (exact policy)
    saved: int = 0  # tokens[:saved] are in the prefix cache already
    # tokens after `tokens` to prefill when idle: (exact) a reply's dropped decode-time KV to redo,
    # (fast) the next turn's header, anticipated after a reply
    tail: list[int] = field(default_factory=list)
    active: Active | None = None
    last_used: float = field(default_factory=time.monotonic)
    # FIM: (the prefix text before the suffix, the suffix, the extra chunks) of the last request here
    fim_head: tuple[str, str, tuple[tuple[str, str], ...]] | None = None
    # KV moved to new positions (reuse_shifted) whose keys llama.cpp re-rotates only at the next
    # llama_decode: until then its state, read out, pairs old rotations with new positions, so it
    # is neither copied to another slot nor saved to the prefix cache
    shift_pending: bool = False

    def reusable(self, prompt: list[int], chunk: int, exact: bool = True,
                 end_of_turn: Callable[[int], bool] = lambda _t: False) -> int:
        """How many leading prompt tokens this slot's KV can serve, always leaving at least one
        token to compute so the request gets fresh logits. Fast policy: any common prefix, token by
        token, decode-time KV included. Exact policy: only KV from aligned prefill, in whole chunks
        (a chunk ends at a multiple of `chunk` or right after an end-of-turn token)."""
        if not exact:
            return max(0, min(common_prefix(self.tokens, prompt), len(prompt) - 1))
        n = common_prefix(self.tokens[: min(self.exact, len(prompt) - 1)], prompt)
        while n > 0 and n % chunk and not end_of_turn(prompt[n - 1]):
            n -= 1
        return n

    def truncate(self, L: Any, mem: Any, n: int) -> None:
        """Keep the KV of the first n tokens, drop the rest (and any tail waiting to be re-prefilled)."""
        if n < len(self.tokens):
            L.llama_memory_seq_rm(mem, self.seq, n, -1)
            del self.tokens[n:]
        self.tail.clear()
        self.exact = min(self.exact, n)
        self.saved = min(self.saved, n)

    def reuse_shifted(self, L: Any, mem: Any, prompt: list[int], n: int, min_run: int) -> int:
        """Keep the first n tokens' KV and, past them, the runs of at least `min_run` tokens that
        continue the prompt and that this slot holds further on, their KV moved down to the
        prompt's positions (llama.cpp re-rotates it) instead of computed again; drop the rest. An
        editor's next request after a new line: the same window slid down a line, every token a
        few places earlier. (Text inserted before a run, as typing before the suffix is, ends the
        reuse there: what follows is computed again, as llama-server's --cache-reuse does.)
        Returns how many leading prompt tokens the slot now serves."""
        runs = shifted_runs(self.tokens, prompt, n, min_run)
        if not runs:
            self.truncate(L, mem, n)
            return n
        # everything not kept goes first; then each run moves down (first first: never onto another)
        at = n
        for c, _p, m in runs:
            if c > at:
                L.llama_memory_seq_rm(mem, self.seq, at, c)
            at = c + m
        L.llama_memory_seq_rm(mem, self.seq, at, -1)
        for c, p, m in runs:  # the prompt positions of the runs follow each other from n on
            if c != p:
                L.llama_memory_seq_add(mem, self.seq, c, c + m, p - c)
                self.shift_pending = True
        served = runs[-1][1] + runs[-1][2]
        self.tokens = list(prompt[:served])
        self.tail.clear()
        self.exact = min(self.exact, n)
        self.saved = min(self.saved, n)
        return served

    def shift_serves(self, prompt: list[int], n: int, min_run: int) -> int:
        """How many leading prompt tokens reuse_shifted would serve, nothing moved."""
        runs = shifted_runs(self.tokens, prompt, n, min_run)
        return runs[-1][1] + runs[-1][2] if runs else n

    def forget(self, L: Any, mem: Any) -> None:
        """Drop the sequence entirely (its KV may be partly written, or is given up)."""
        L.llama_memory_seq_rm(mem, self.seq, -1, -1)
        self.tokens.clear()
        self.tail.clear()
        self.exact = self.saved = 0


def shifted_runs(cache: list[int], prompt: list[int], n: int, min_run: int) -> list[tuple[int, int, int]]:
    """Past the first n tokens, the runs of at least `min_run` tokens of `cache` that continue
    `prompt` in order: (position in the cache, position in the prompt, length). Placement asks it
    of every free slot for each editor request: each run's start is found by bytes.find over the
    tokens as 4-byte ints (a token-by-token scan took 0.18 s for a 32k-token slot of near misses)."""
    runs: list[tuple[int, int, int]] = []
    head_c = head_p = n
    end = len(prompt) - 1  # at least one token is computed: the request needs fresh logits
    if min_run < 1 or head_c >= len(cache) or end - head_p < min_run:
        return runs
    held = array("i", cache).tobytes()
    while head_c < len(cache) and end - head_p >= min_run:
        needle = array("i", prompt[head_p:head_p + min_run]).tobytes()
        at = held.find(needle, head_c * 4)
        while at % 4 and at != -1:  # a match across token boundaries: look on
            at = held.find(needle, at + 1)
        if at == -1:
            break
        c, m = at // 4, min_run
        while c + m < len(cache) and head_p + m < end and cache[c + m] == prompt[head_p + m]:
            m += 1
        runs.append((c, head_p, m))
        head_c, head_p = c + m, head_p + m
    return runs
