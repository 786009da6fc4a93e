"""The rows of one engine step (issue 49: out of engine.py): each decoding slot's pending token and
its drafts, then slices of the prompts being read, within the step's budget and the attention
kernel's rules (prompt_rows.py), written into llama.cpp's batch in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmd.backends.llamacpp.batch import put
from llmd.backends.llamacpp.slots import Slot
from llmd.backends.llamacpp.speculation import LENGTHS
from llmd.priority import class_index

if TYPE_CHECKING:
    from llmd.backends.llamacpp.engine import LlamaCppEngine

BESIDE_ROWS = 64  # the most rows of a lower class's prompt in a step with a higher class's stream


@dataclass
class StepBatch:
    """What one llama_decode holds, and where each slot's rows are in it."""

    rows: list[tuple[Slot, list[int], int, int]] = field(default_factory=list)  # slot, tokens, first position, prompt end (-1: decoding)
    plan: list[tuple[Slot, int, list[int]]] = field(default_factory=list)  # decoding slot, its first row, its drafts
    parts: list[tuple[Slot, int, int, int]] = field(default_factory=list)  # prefilling slot, prompt start, end, first row
    n: int = 0

    @property
    def slots(self) -> list[Slot]:
        return [*(p[0] for p in self.plan), *(p[0] for p in self.parts)]


class BatchBuilder:
    def __init__(self, engine: LlamaCppEngine) -> None:
        self.e = engine

    def build(self, decoding: list[Slot], prefilling: list[Slot]) -> StepBatch:
        """Each decoding slot's pending token (plus its drafts when it speculates), then prompt
        rows of the prefilling slots in their order, up to the step's budget while streams run
        (the whole batch when nothing else does; fewer while other models contend for the CPU:
        cpu_board.Turns.step_rows)."""
        e = self.e
        b = StepBatch()
        drafts_of: dict[int, list[int]] = {}
        if decoding:
            with e.profiler.span("draft"):
                spec = [s for s in decoding if s.active and s.active.drafters]
                drafts_of = dict(zip((s.seq for s in spec), e.spec.plan([e._job(s) for s in spec], len(decoding)),
                                     strict=True))
        with e.profiler.span("batch_build"):
            for slot in decoding:
                a = slot.active
                assert a is not None and a.pending is not None
                drafts = drafts_of.get(slot.seq, [])[: max(0, e.n_batch - b.n - len(decoding) + len(b.rows))]
                b.rows.append((slot, [a.pending, *drafts], len(slot.tokens), -1))
                b.n += 1 + len(drafts)
            self._prompt_rows(b, decoding, prefilling)
            self._write(b)
        return b

    def _prompt_rows(self, b: StepBatch, decoding: list[Slot], prefilling: list[Slot]) -> None:
        e = self.e
        budget = e.n_batch - b.n if not decoding else min(e.budget, e.n_batch - b.n)
        if e.board_rows is not None:
            budget = min(budget, e.board_rows)
        deepest = max((len(s.tokens) + 1 + max(LENGTHS) for s in decoding), default=0)
        first = min((class_index(s.active.req.priority) for s in (*decoding, *prefilling) if s.active), default=0)
        # a prompt of the most urgent class is read alone: the step that gives a person's first
        # token holds no aged lower class's rows (a 64-row slice of an agent's prompt at a few
        # thousand tokens' depth costs the 1.5B about a second, more than a chat's own 16 new
        # tokens); beside that class's decoding streams an aged prompt still takes its slice
        reading_first = any(s.active and class_index(s.active.req.priority) == first for s in prefilling)
        for slot in prefilling:
            if budget <= 0:
                break
            a = slot.active
            assert a is not None
            start = a.pos
            # a prompt of a lower class here only because it aged (llmd.priority) takes a short slice
            # beside a person's request: a 512-row slice of an agent's prompt beside a chat's 16 new
            # tokens held the chat's first token 10 s (benchmarks/desktop.py)
            if class_index(a.req.priority) <= first:
                rows = budget
            elif reading_first:
                continue
            else:
                rows = min(budget, BESIDE_ROWS)
            end = e.grid.chunk_end(a.prompt, start) if e.exact else min(len(a.prompt), start + rows)
            deepest = max(deepest, end)
            end = e.rows.end(len(a.prompt), start, min(end, start + e.rows.room(b.n, deepest)))
            b.rows.append((slot, a.prompt[start:end], start, end))
            b.n += end - start
            budget -= end - start

    def _write(self, b: StepBatch) -> None:
        """Into llama.cpp's batch in slot order: with one KV stream per slot llama.cpp splits a batch
        into passes that each take only consecutive sequence ids in batch order, so decoding slots
        0, 2, 3 with slot 1 prefilling after them took three passes where this order takes two."""
        batch = self.e.batch
        row = 0
        for slot, tokens, pos, end in sorted(b.rows, key=lambda r: r[0].seq):
            last = len(slot.active.prompt) if slot.active is not None else -1
            for j, t in enumerate(tokens):
                put(batch, row + j, t, pos + j, slot.seq, end < 0 or pos + j == last - 1)
            if end < 0:
                b.plan.append((slot, row, tokens[1:]))
            else:
                b.parts.append((slot, pos, end, row))
            row += len(tokens)
        batch.n_tokens = b.n
