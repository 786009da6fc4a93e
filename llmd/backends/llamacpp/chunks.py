"""The exact policy's chunk boundaries: at every multiple of the chunk size, and right after each
end-of-turn token, so a conversation prefilled whole and one prefilled turn by turn are cut into
the same chunks (and so get the same KV). Pure functions of the tokens: tested on their own.
"""

from __future__ import annotations

from collections.abc import Callable

from llmd.backends.llamacpp.slots import Slot


class ChunkGrid:
    def __init__(self, chunk: int, end_of_turn: Callable[[int], bool]) -> None:
        self.chunk = chunk
        self.end_of_turn = end_of_turn

    def is_boundary(self, tokens: list[int], end: int) -> bool:
        return end % self.chunk == 0 or (end > 0 and self.end_of_turn(tokens[end - 1]))

    def chunk_end(self, tokens: list[int], start: int) -> int:
        """Where the chunk starting at `start` ends: the next grid point, or right after an
        end-of-turn token before it (or the end of the tokens)."""
        grid = min(len(tokens), (start // self.chunk + 1) * self.chunk)
        for i in range(start, grid - 1):
            if self.end_of_turn(tokens[i]):
                return i + 1
        return grid

    def reprefill_end(self, slot: Slot) -> int | None:
        """The end of the next whole chunk past the slot's exact KV (its reply, decoded, is not
        exact until re-prefilled), or None when no whole chunk is left."""
        seq = slot.tokens + slot.tail
        if slot.exact >= len(seq):
            return None
        end = self.chunk_end(seq, slot.exact)
        return end if self.is_boundary(seq, end) else None
