"""Leaving out the oldest messages of a chat longer than the context (chat/fit.py), with a stand-in
for the engine's template: one token per word, a template that refuses a history starting with a reply."""

from __future__ import annotations

import pytest

from llmd.chat.fit import fit_by_dropping
from llmd.errors import BadRequest, ContextOverflow


def render(messages: list[dict], tools: list[dict] | None) -> list[int]:
    if next(m for m in messages if m["role"] != "system")["role"] != "user":
        raise BadRequest("turns must start with a user message")
    return [0] * sum(len(m["content"].split()) for m in messages)


def msg(role: str, words: int) -> dict:
    return {"role": role, "content": " ".join(["w"] * words)}


def test_the_fewest_old_messages_go_and_the_history_starts_at_a_user_message():
    chat = [msg("system", 10), msg("user", 30), msg("assistant", 30), msg("user", 30), msg("assistant", 30),
            msg("user", 10)]
    dropped, prompt = fit_by_dropping(chat, None, 100, 10, len(render(chat, None)), render)
    assert dropped == 2 and len(prompt) == 10 + 30 + 30 + 10  # system, the second exchange, the newest


def test_a_newest_message_that_cannot_fit_is_a_context_overflow_that_says_the_numbers():
    chat = [msg("system", 10), msg("user", 30), msg("assistant", 30), msg("user", 200)]
    with pytest.raises(ContextOverflow, match="context holds 100"):
        fit_by_dropping(chat, None, 100, 10, 270, render)
