"""A chat longer than the model's context: which older messages to leave out (a chat concern, kept
out of the engine, which renders the chat to tokens with ChatTemplate.tokens)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmd.errors import BadRequest, ContextOverflow

# messages and tools to the prompt's tokens; BadRequest when the template refuses them
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]


def fit_by_dropping(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, n_ctx: int,
                    max_tokens: int | None, full: int, render: Render) -> tuple[int, list[int]]:
    """As Ollama does for a chat longer than its context: leave out the oldest whole messages,
    keeping every system message and the newest message, until the prompt (`full` tokens whole)
    fits with room to answer (max_tokens, at most a quarter of the context; an eighth when unset;
    less room when that is all there is). The history kept starts at a user message (a template
    that enforces turns, Gemma's or Mistral's, refuses one that starts with a reply or a tool
    result, and a tool result without its call answers nothing), and a template that refuses a
    cut counts as "does not fit yet". The fewest messages are dropped (a binary search over the
    cuts). ContextOverflow when even the system messages and the newest one do not fit."""
    room = min(max_tokens or n_ctx // 8, n_ctx // 4)
    old = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]
    # where the kept history may start: at a user message, or after all of the old ones
    cuts = [j for j, i in enumerate(old) if j > 0 and messages[i].get("role") == "user"] + [len(old)]

    def without(j: int) -> list[dict[str, Any]]:
        gone = set(old[:j])
        return [m for i, m in enumerate(messages) if i not in gone]

    def fits(j: int) -> list[int] | None:
        try:
            prompt = render(without(j), tools)
        except BadRequest:  # the template refuses this cut: as if it did not fit
            return None
        return prompt if len(prompt) + room <= n_ctx else None

    def overflow(most: int) -> ContextOverflow:
        return ContextOverflow(
            f"the prompt is {full} tokens but the context holds {n_ctx}, and with all {len(old)} older "
            f"messages left out it is still {most or full}: shorten the system or the newest message, "
            "or raise the context (options.num_ctx, LLMD_CTX)", "messages")

    if not old:
        raise overflow(0)
    lo, hi, best = 0, len(cuts) - 1, None
    while lo <= hi:  # the first cut that fits: fitting grows with the cut
        mid = (lo + hi) // 2
        prompt = fits(cuts[mid])
        if prompt is not None:
            best, hi = (cuts[mid], prompt), mid - 1
        else:
            lo = mid + 1
    if best is None:
        try:
            most = len(render(without(len(old)), tools))
        except BadRequest:
            most = 0
        if most and most < n_ctx:  # fits without room for the usual reply: answer in what is left
            return len(old), render(without(len(old)), tools)
        raise overflow(most)
    return best[0], best[1]
