"""Native llama.cpp sampler chains, one per request: no Python-side sampling in the hot path."""

from __future__ import annotations

import ctypes
import random
import re
from typing import Any

from llmd.backends.base import Sampling
from llmd.errors import GrammarError


class SamplerChain:
    """Owns a llama_sampler chain; `sample(ctx, i)` samples and accepts the token of output row i."""

    def __init__(self, vocab: Any, n_vocab: int, sampling: Sampling, grammar: str | None, trigger: str = "") -> None:
        """`trigger`: the grammar is lazy, applied from the first occurrence of this text on."""
        import llama_cpp as L

        self._L = L
        params = L.llama_sampler_chain_default_params()
        params.no_perf = True
        self.chain = L.llama_sampler_chain_init(params)
        add = lambda s: L.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if grammar is not None:
            if trigger:
                pattern = (ctypes.c_char_p * 1)(lazy_pattern(trigger).encode())
                g = L.llama_sampler_init_grammar_lazy_patterns(vocab, grammar.encode(), b"root", pattern, 1, None, 0)
            else:
                g = L.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not g:
                self.close()
                raise GrammarError("the grammar for response_format did not parse", "response_format")
            add(g)
        s = sampling
        if s.presence_penalty or s.frequency_penalty or s.repeat_penalty != 1.0:
            add(L.llama_sampler_init_penalties(n_vocab, 64, s.repeat_penalty, s.frequency_penalty, s.presence_penalty))
        if s.greedy:
            add(L.llama_sampler_init_greedy())
            return
        if s.top_k > 0:
            add(L.llama_sampler_init_top_k(s.top_k))
        if s.top_p < 1.0:
            add(L.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0.0:
            add(L.llama_sampler_init_min_p(s.min_p, 1))
        add(L.llama_sampler_init_temp(s.temperature))
        seed = s.seed if s.seed is not None else random.getrandbits(32)
        add(L.llama_sampler_init_dist(seed % 0xFFFFFFFF))  # 0xFFFFFFFF would mean 'random'

    def sample(self, ctx: Any, row: int) -> int:
        return int(self._L.llama_sampler_sample(self.chain, ctx, row))

    def close(self) -> None:
        if self.chain:
            self._L.llama_sampler_free(self.chain)
            self.chain = None


def lazy_pattern(trigger: str) -> str:
    """The pattern a lazy grammar waits for. llama.cpp searches all text written so far with it after
    every token until it is found, and feeds the grammar from group 1: the trigger alone, so each
    search is one pass over the text (`[\\s\\S]*?(trigger)[\\s\\S]*` made each one quadratic: a
    reply with tools offered slowed to 0.42x of the same reply without tools over 1,200 tokens,
    benchmarks/tool_reply.py)."""
    return f"({re.escape(trigger)})"


def token_logprobs(ctx: Any, row: int, token: int, n_vocab: int, top: int,
                   text_of: Any) -> tuple[str, float, tuple[tuple[str, float], ...]]:
    """The model's log-probability of `token` at output row `row` (from the raw logits, before
    temperature and penalties, as OpenAI reports them) and the `top` most likely tokens."""
    import llama_cpp as L
    import numpy as np

    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).astype(np.float64)
    peak = logits.max()
    logz = peak + np.log(np.exp(logits - peak).sum())
    best: tuple[tuple[str, float], ...] = ()
    if top > 0:
        idx = np.argpartition(-logits, top)[:top]
        idx = idx[np.argsort(-logits[idx])]
        best = tuple((text_of(int(i)), float(logits[i] - logz)) for i in idx)
    return text_of(token), float(logits[token] - logz), best
