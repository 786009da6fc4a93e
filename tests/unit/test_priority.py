"""The priority classes: which class a request gets and why, and the order they run in."""

from __future__ import annotations

import pytest

from llmd.backends.base import FimPrompt, GenerationRequest
from llmd.errors import BadRequest
from llmd.priority import AGING_S, classify, rank


def chat(text: str, tools: bool = False) -> GenerationRequest:
    return GenerationRequest(id="r", messages=[{"role": "user", "content": text}],
                             tools=[{"type": "function", "function": {"name": "f"}}] if tools else None)


def test_each_request_gets_a_class_and_a_reason():
    assert classify({}, chat("hi"), stream=True) == ("interactive", "streamed to someone watching")
    assert classify({}, chat("fix it", tools=True), stream=True)[0] == "agent"
    title = chat("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.")
    assert classify({}, title, stream=False)[0] == "background"
    fim = GenerationRequest(id="f", fim=FimPrompt(prefix="def f(", suffix=")"))
    assert classify({}, fim, stream=False)[0] == "interactive"
    assert classify({"x-llmd-priority": "Background"}, chat("hi"), stream=True) == (
        "background", "asked for (X-LLMD-Priority)")
    with pytest.raises(BadRequest, match="interactive, agent, background"):
        classify({"x-llmd-priority": "urgent"}, chat("hi"), stream=True)


def test_a_higher_class_runs_first_and_a_waiting_one_rises():
    assert rank("interactive", 0) < rank("agent", 0) < rank("background", 0)
    assert rank("background", 2 * AGING_S) == rank("interactive", 0)  # never starved
    assert rank("agent", AGING_S - 1) == rank("agent", 0)  # within a rank the engine's order holds
