"""Drafters propose tokens for the target to verify in the step's batch.

NgramDrafter is prompt lookup over the slot's own tokens (prompt and generated): find the most
recent earlier occurrence of the longest suffix (up to `max_n` tokens) and propose what followed.
It costs no model and shines when the reply copies from the prompt (code edits, quotes, JSON).
"""

from __future__ import annotations


class NgramDrafter:
    def __init__(self, max_n: int = 4, min_n: int = 2, window: int = 4096) -> None:
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        n_tok = len(tokens)
        lo = max(0, n_tok - self.window)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = tokens[n_tok - n:]
            first = suffix[0]
            # most recent earlier occurrence whose continuation exists
            for i in range(n_tok - n - 1, lo - 1, -1):
                if tokens[i] == first and tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + k]
        return []
