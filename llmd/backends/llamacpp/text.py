"""Incremental detokenization: whole UTF-8 characters only, and stop strings that never leak.

A token's bytes may end inside a multi-byte character; the incremental decoder keeps the
tail until the character is complete. Text that could be the start of a stop string is held
back until it either completes the stop (then it is cut, with everything after it) or can no
longer match (then it is released).
"""

from __future__ import annotations

import codecs
import time

from llmd.chat.fim import Cut


class TextStream:
    def __init__(self, stops: tuple[str, ...] = (), cut: Cut | None = None) -> None:
        """`cut`: a fill-in-the-middle reply also ends where an editor would show it end."""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self._cut = cut

    def push(self, data: bytes) -> tuple[str, bool]:
        """Add a token's bytes; return (text safe to emit now, whether a stop was hit)."""
        out, stop = self._push(data)
        if self._cut is None:
            return out, stop
        out = self._cut.feed(out, time.perf_counter())
        return out, stop or self._cut.done

    def _push(self, data: bytes) -> tuple[str, bool]:
        self._pending += self._decoder.decode(data)
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, False
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._pending = self._pending[:cut], ""
            return out, True
        hold = self._held_suffix()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        return out, False

    def flush(self) -> str:
        """At the end of generation: release held text and any incomplete character."""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        if self._cut is not None:
            out = self._cut.feed(out, time.perf_counter()) + self._cut.flush()
        return out

    def _held_suffix(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        best = 0
        text = self._pending
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
