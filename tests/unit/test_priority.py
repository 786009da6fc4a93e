"""The priority classes: which class a request gets and why, and the order they run in."""

from __future__ import annotations

import pytest

from llmd.backends.base import FimPrompt, GenerationRequest
from llmd.errors import BadRequest
from llmd.priority import AGING_S, classify, classify_embedding, rank


def chat(text: str, tools: bool = False) -> GenerationRequest:
    return GenerationRequest(id="r", messages=[{"role": "user", "content": text}],
                             tools=[{"type": "function", "function": {"name": "f"}}] if tools else None)


def test_each_request_gets_a_class_and_a_reason():
    assert classify({}, chat("hi"), stream=True) == ("interactive", "streamed to someone watching")
    assert classify({}, chat("fix it", tools=True), stream=True)[0] == "agent"
    title = chat("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.")
    assert classify({}, title, stream=False)[0] == "background"
    # opencode asks for its session's title beside the first question, streamed, on the same model
    opencode = GenerationRequest(id="t", messages=[
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title. Nothing else."},
        {"role": "user", "content": "Generate a title for this conversation:\n"},
        {"role": "user", "content": "Create a file named hello.txt that contains the word hi."}])
    assert classify({}, opencode, stream=True) == ("background", "a front end's own task request (opencode's session title)")
    # a person's own chat that mentions a title stays interactive
    assert classify({}, chat("You are a title generator? Write me a title."), stream=True)[0] == "interactive"
    fim = GenerationRequest(id="f", fim=FimPrompt(prefix="def f(", suffix=")"))
    assert classify({}, fim, stream=False)[0] == "interactive"
    assert classify({"x-llmd-priority": "Background"}, chat("hi"), stream=True) == (
        "background", "asked for (X-LLMD-Priority)")
    with pytest.raises(BadRequest, match="interactive, agent, background"):
        classify({"x-llmd-priority": "urgent"}, chat("hi"), stream=True)
    # or the body's priority field
    assert classify({}, chat("hi"), True, body_asks="agent") == ("agent", "asked for (the body's priority field)")
    assert classify({"x-llmd-priority": "agent"}, chat("hi"), True, body_asks="Agent")[0] == "agent"
    with pytest.raises(BadRequest, match="priority 'soon' is not a class"):
        classify({}, chat("hi"), True, body_asks="soon")
    with pytest.raises(BadRequest, match="X-LLMD-Priority says 'agent' and the body's priority says 'background'"):
        classify({"x-llmd-priority": "agent"}, chat("hi"), True, body_asks="background")


def test_an_embedding_batch_is_background_unless_asked():
    assert classify_embedding({}) == ("background", "an embedding batch")
    assert classify_embedding({}, "Interactive") == ("interactive", "asked for (the body's priority field)")
    assert classify_embedding({"x-llmd-priority": "agent"})[0] == "agent"
    with pytest.raises(BadRequest, match="priority 'soon' is not a class"):
        classify_embedding({}, "soon")


def test_a_higher_class_runs_first_and_a_waiting_one_rises():
    assert rank("interactive", 0) < rank("agent", 0) < rank("background", 0)
    assert rank("background", 2 * AGING_S) == rank("interactive", 0)  # never starved
    assert rank("agent", AGING_S - 1) == rank("agent", 0)  # within a rank the engine's order holds
