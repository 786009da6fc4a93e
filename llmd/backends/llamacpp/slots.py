"""Slot and request state for the llama.cpp step loop.

A slot is one sequence id in the shared context. It remembers which tokens its KV holds and
how many of them were computed by aligned prefill chunks (`exact`): only those are reused,
because decode-time KV differs slightly from what prefill computes (DESIGN: Determinism).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    cached: int = 0
    t_admitted: float = 0.0
    pos: int = 0  # next prompt index to prefill
    pending: int | None = None  # sampled token not yet decoded into the KV
    n_gen: int = 0
    t_first: float = 0.0
    t_last: float = 0.0
    t_prefill_done: float = 0.0
    cancelled: bool = False
    drafters: tuple[str, ...] = ()  # which may draft for it: "ngram", "draft" (the draft model)
    accept_ema: dict[str, float] = field(default_factory=dict)  # per drafter: recent share accepted
    last_drafter: str = ""  # who drafted this step ("" = nobody)
    steps_without_draft: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)


@dataclass
class Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds, in order
    exact: int = 0  # tokens[:exact] came from aligned prefill chunks (a multiple of the chunk)
    saved: int = 0  # tokens[:saved] are in the disk prefix cache already
    tail: list[int] = field(default_factory=list)  # tokens after `tokens` whose KV was dropped, to re-prefill
    active: Active | None = None
    last_used: float = field(default_factory=time.monotonic)

    def reusable(self, prompt: list[int], chunk: int) -> int:
        """How many leading prompt tokens this slot can serve from exact KV, in whole chunks,
        always leaving at least one token to compute so the request gets fresh logits."""
        limit = min(self.exact, len(prompt))
        n = 0
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        n -= n % chunk
        if n >= len(prompt):
            n = max(0, (len(prompt) - 1) // chunk * chunk)
        return n
