"""The rows of one step (backends/llamacpp/step_batch.py): a prompt of a lower class that shares a
step with a higher class's request takes at most BESIDE_ROWS of it; alone it takes the budget."""

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
    turn_rows: int | None = None
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


def test_an_aged_agent_prompt_takes_a_short_slice_beside_a_chat_and_the_whole_budget_alone():
    e = _Engine()
    chat, agent = _reading(0, "interactive", 16), _reading(1, "agent", 4000)
    # the agent's prompt aged to the chat's rank and comes first in the engine's order
    assert _rows(BatchBuilder(e).build([], [agent, chat])) == {1: BESIDE_ROWS, 0: 16}
    assert _rows(BatchBuilder(e).build([], [_reading(1, "agent", 4000)])) == {1: 512}
    # two prompts of one class share the budget in the engine's order
    assert _rows(BatchBuilder(e).build([], [_reading(1, "agent", 4000), _reading(2, "agent", 4000)])) == {1: 512}
