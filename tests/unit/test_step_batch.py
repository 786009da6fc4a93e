"""The rows of one step (backends/llamacpp/step_batch.py): a prompt of a lower class takes no rows
of a step that reads a higher class's prompt, at most BESIDE_ROWS beside a higher class's stream,
and the budget alone."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import llama_cpp

from llmd.backends.llamacpp.prompt_rows import PromptRows
from llmd.backends.llamacpp.slots import Slot
from llmd.backends.llamacpp.step_batch import BESIDE_ROWS, BatchBuilder


class _Profiler:
    def span(self, _name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass
class _Engine:
    n_batch: int = 512
    budget: int = 512
    board_rows: int | None = None
    exact: bool = False
    rows: PromptRows = field(default_factory=lambda: PromptRows(True, 512, 12, 8192))
    profiler: _Profiler = field(default_factory=_Profiler)
    batch: Any = field(default_factory=lambda: llama_cpp.llama_batch_init(512, 0, 4))


def _reading(seq: int, priority: str, n_prompt: int) -> Slot:
    slot = Slot(seq)
    slot.active = SimpleNamespace(req=SimpleNamespace(priority=priority), prompt=list(range(n_prompt)), pos=0)  # type: ignore[assignment]
    return slot


def _rows(b: Any) -> dict[int, int]:
    return {slot.seq: end - start for slot, start, end, _row in b.parts}


def _decoding(seq: int, priority: str) -> Slot:
    slot = Slot(seq, tokens=list(range(20)))
    slot.active = SimpleNamespace(req=SimpleNamespace(priority=priority), prompt=list(range(20)), pos=20,  # type: ignore[assignment]
                                  pending=7, drafters=())
    return slot


def test_an_aged_agent_prompt_waits_while_a_chats_prompt_is_read_and_takes_a_short_slice_beside_its_stream():
    e = _Engine()
    chat, agent = _reading(0, "interactive", 16), _reading(1, "agent", 4000)
    # the agent's prompt aged to the chat's rank and comes first in the engine's order: the step
    # that reads the chat's prompt (and gives its first token) holds none of it
    assert _rows(BatchBuilder(e).build([], [agent, chat])) == {0: 16}
    # beside the chat's reply being decoded it takes a short slice
    e.spec = SimpleNamespace(plan=lambda jobs, n: [])  # type: ignore[attr-defined]
    assert _rows(BatchBuilder(e).build([_decoding(0, "interactive")], [_reading(1, "agent", 4000)])) == {1: BESIDE_ROWS}
    assert _rows(BatchBuilder(e).build([], [_reading(1, "agent", 4000)])) == {1: 512}
    # two prompts of one class share the budget in the engine's order
    assert _rows(BatchBuilder(e).build([], [_reading(1, "agent", 4000), _reading(2, "agent", 4000)])) == {1: 512}
