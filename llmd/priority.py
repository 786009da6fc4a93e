"""Which requests run first: three classes, the rule that gives each request one, and the rank
the engine orders by (issue 48: an editor, a chat and an agent on one machine).

- interactive: someone waits on it now (fill-in-the-middle, a streamed chat, a reply asked for);
- agent: an agent's turn (tools offered): minutes of work nobody watches token by token;
- background: a front end's own task requests (Open WebUI's titles, tags and follow-ups) and
  embedding batches.

A client may say its class with the X-LLMD-Priority header. A waiting request rises one class
for every AGING_S it has waited, so no class is ever starved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmd.errors import BadRequest

CLASSES = ("interactive", "agent", "background")
HEADER = "x-llmd-priority"
AGING_S = 20.0


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


def classify(headers: Mapping[str, str], req: Any, stream: bool) -> tuple[str, str]:
    """(class, why) of a generation request; a 400 for an X-LLMD-Priority that names no class."""
    asked = headers.get(HEADER, "").strip().lower()
    if asked:
        if asked not in CLASSES:
            raise BadRequest(f"X-LLMD-Priority {asked[:40]!r} is not a class; use one of {', '.join(CLASSES)}",
                             "X-LLMD-Priority")
        return asked, "asked for (X-LLMD-Priority)"
    if req.fim is not None:
        return "interactive", "fill-in-the-middle: an editor waits on it"
    last_user = next((m for m in reversed(req.messages or []) if m.get("role") == "user"), None)
    if last_user is not None and _text_of(last_user.get("content")).lstrip().startswith("### Task:"):
        return "background", "a front end's own task request (Open WebUI's titles, tags, follow-ups)"
    if req.tools:
        return "agent", "tools offered: an agent's turn"
    return "interactive", "streamed to someone watching" if stream else "a reply someone waits for"
