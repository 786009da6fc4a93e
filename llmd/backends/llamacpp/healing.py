"""Token healing for fill-in-the-middle: what is decoded first must begin with a given text.

An editor's request may end anywhere in a word (`ret` of `return`, the spaces before a word). In
llmd's FIM layout the cursor's line comes last (llmd.chat.fim.healed_fim_tokens), and a prompt that
ends inside what the tokenizer would have made one token is a split the model never saw: its
completions collapse. So the line's last token is left out, and the tokens decoded first must spell
that token's text: each one either begins with what is left of it (`return` for `ret`) or is a
start of it (`   ` for four spaces, when the model's own split of `    return` is `   ` + ` return`),
until the text is spent. The vocabulary's pieces are sorted once, at the first request that needs
them (about 0.5 s for Qwen's 151,000 tokens), so the tokens that begin with a text are a range.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np


class Healer:
    def __init__(self, piece: Callable[[int], bytes], n_vocab: int) -> None:
        self.piece = piece  # a token's text (bytes), special tokens as nothing
        self.n_vocab = n_vocab
        self._pieces: list[bytes] = []
        self._ids: list[int] = []

    def _index(self) -> None:
        pairs = sorted((self.piece(t), t) for t in range(self.n_vocab))
        self._pieces = [p for p, _ in pairs]
        self._ids = [t for _, t in pairs]

    def _range(self, text: bytes) -> tuple[int, int]:
        """Where the pieces that begin with `text` lie in the sorted list."""
        lo = bisect.bisect_left(self._pieces, text)
        end = text.rstrip(b"\xff")  # the first text after every one that begins with `text`
        hi = (bisect.bisect_left(self._pieces, end[:-1] + bytes([end[-1] + 1]), lo) if end
              else len(self._pieces))
        return lo, hi

    def allowed(self, text: bytes) -> np.ndarray:
        """The ids of every token that may come next while `text` is still to be spelled: those
        whose text begins with it, and those whose text is a (non-empty) start of it."""
        if not self._pieces:
            self._index()
        lo, hi = self._range(text)
        ids = self._ids[lo:hi]
        for k in range(1, len(text)):
            at = bisect.bisect_left(self._pieces, text[:k])
            while at < len(self._pieces) and self._pieces[at] == text[:k]:
                ids.append(self._ids[at])
                at += 1
        return np.array(ids, dtype=np.int64)

    def restrict(self, L: Any, ctx: Any, row: int, allowed: np.ndarray) -> None:
        """Leave only `allowed` tokens possible in the logits of `row`, for the sampler that reads them next."""
        ptr = L.llama_get_logits_ith(ctx, row)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        keep = logits[allowed].copy()
        logits[:] = -np.inf
        logits[allowed] = keep


def spend(heal: bytes, piece: bytes) -> tuple[bytes, bytes]:
    """A decoded token's `piece` against the text still to be healed: (what is left to heal, what
    of the piece is the reply's). The healed text is the prompt's, so it is not shown again."""
    n = min(len(heal), len(piece))
    return heal[n:], piece[n:]
