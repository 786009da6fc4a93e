"""Which requests run first: three classes, the rule that gives each request one, and the rank
the engine orders by (issue 48: an editor, a chat and an agent on one machine).

- interactive: someone waits on it now (fill-in-the-middle, a streamed chat, a reply asked for);
- agent: an agent's turn (tools offered): minutes of work nobody watches token by token;
- background: a front end's own task requests (Open WebUI's titles, tags and follow-ups, opencode's
  session titles) and embedding batches (unless the client asks: a chat's retrieval query is
  waited on).

A client may say its class with the X-LLMD-Priority header or a `priority` field in the body. A
waiting request rises one class for every AGING_S it has waited, so no class is ever starved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmd.errors import BadRequest

CLASSES = ("interactive", "agent", "background")
HEADER = "x-llmd-priority"
AGING_S = 20.0

# How front ends mark the requests they send for themselves beside the person's own (the role
# whose text starts with it, the prefix, the front end): a title nobody waits for must not hold
# the chat question that arrives with it (issue 48: opencode's 545-token title request, classed
# interactive, made the desktop's first chat answer wait 8 s).
FRONT_END_TASKS = (
    ("user", "### Task:", "Open WebUI's titles, tags, follow-ups"),
    ("system", "You are a title generator", "opencode's session title"),
)


def class_index(cls: str) -> int:
    """The class's place in CLASSES (0 for a name that is none: interactive, as an unset class)."""
    return CLASSES.index(cls) if cls in CLASSES else 0


def rank(cls: str, waited_s: float) -> int:
    """Lower runs first: the class's place, less one for every whole AGING_S waited (within a rank
    the engine's own order holds: an editor's completion first, then the oldest)."""
    return class_index(cls) - int(max(0.0, waited_s) // AGING_S)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


def _front_end_task(messages: list[dict[str, Any]]) -> str | None:
    """Which front end's own task request this chat is (FRONT_END_TASKS), if any: the last user
    message or the first system message is read, as each front end puts its marker there."""
    marked = {"user": next((m for m in reversed(messages) if m.get("role") == "user"), None),
              "system": next((m for m in messages if m.get("role") == "system"), None)}
    for role, prefix, who in FRONT_END_TASKS:
        m = marked[role]
        if m is not None and _text_of(m.get("content")).lstrip().startswith(prefix):
            return who
    return None


def _asked(headers: Mapping[str, str], body_asks: str) -> tuple[str, str] | None:
    """(class, why) as the client asked for it, or None; a 400 for a class that is none, or for a
    header and a field that disagree."""
    header = headers.get(HEADER, "").strip().lower()
    field = body_asks.strip().lower()
    for asked, where in ((header, "X-LLMD-Priority"), (field, "priority")):
        if asked and asked not in CLASSES:
            raise BadRequest(f"{where} {asked[:40]!r} is not a class; use one of {', '.join(CLASSES)}", where)
    if header and field and header != field:
        raise BadRequest(f"X-LLMD-Priority says {header!r} and the body's priority says {field!r}; send one",
                         "priority")
    if header:
        return header, "asked for (X-LLMD-Priority)"
    if field:
        return field, "asked for (the body's priority field)"
    return None


def classify_embedding(headers: Mapping[str, str], body_asks: str = "") -> tuple[str, str]:
    """(class, why) of an embedding batch: background (an indexer's) unless the client asks for
    another class, as a chat embedding the person's question for retrieval may."""
    return _asked(headers, body_asks) or ("background", "an embedding batch")


def classify(headers: Mapping[str, str], req: Any, stream: bool, body_asks: str = "") -> tuple[str, str]:
    """(class, why) of a generation request: as the client asks (the X-LLMD-Priority header or the
    body's `priority` field), else by what it is. A 400 for a class that is none, or for a header
    and a field that disagree."""
    if (asked := _asked(headers, body_asks)) is not None:
        return asked
    if req.fim is not None:
        return "interactive", "fill-in-the-middle: an editor waits on it"
    if (task := _front_end_task(req.messages or [])) is not None:
        return "background", f"a front end's own task request ({task})"
    if req.tools:
        return "agent", "tools offered: an agent's turn"
    return "interactive", "streamed to someone watching" if stream else "a reply someone waits for"
