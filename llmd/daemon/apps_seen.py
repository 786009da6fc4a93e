"""Which apps use which models, and how much of the engine each got (issue 48: a desktop runs an
editor, a chat and an agent at once; status, the dashboard and the tray say who is using what).

An app is named from what a local server can see: the API key it was configured with when it is
not llmd's own token (apps are told to send any token), else its Origin (a browser page), else the
first product of its User-Agent ("Continue/1.2 (…)" is "Continue"). Requests are kept for WINDOW_S;
the summary is per app and model: requests, seconds of engine time (from arrival to the last
token), tokens and the requests of each priority class (llmd.priority), over that window.
"""

from __future__ import annotations

import collections
import hashlib
import time
from dataclasses import dataclass
from typing import Any

WINDOW_S = 600.0  # "the last minutes" of status
MAX_KEPT = 10_000  # requests remembered in the window, oldest dropped first


@dataclass(frozen=True)
class _Done:
    at: float  # monotonic
    app: str
    model: str
    engine_s: float
    tokens: int
    priority: str


def printable(text: str, limit: int) -> str:
    """`text` as a log line or header may carry it: ASCII from space to tilde, else '?', at most `limit`."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:limit])


def app_name(headers: Any, token: str | None = None) -> str:
    """The app that sent a request with these headers (see the module's docstring), printable and short."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    key = key.strip() or headers.get("x-api-key", "").strip()
    if key and key != token:  # a key the person gave this app; only a digest of it is shown
        label = f"key:{hashlib.sha256(key.encode()).hexdigest()[:8]}"
    elif origin := headers.get("origin", ""):
        label = origin
    else:
        agent = headers.get("user-agent", "").strip()
        label = agent.split(" ", 1)[0].split("/", 1)[0] if agent else "(no user-agent)"
    return printable(label, 60) or "(unnamed)"


class AppsSeen:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._done: collections.deque[_Done] = collections.deque(maxlen=MAX_KEPT)

    def record(self, app: str, model: str, engine_s: float, tokens: int, now: float | None = None,
               priority: str = "interactive") -> None:
        self._done.append(_Done(time.monotonic() if now is None else now, app, model, max(0.0, engine_s), tokens,
                                priority))

    def summary(self, now: float | None = None) -> list[dict[str, Any]]:
        """Per app and model over the window, the most engine time first."""
        now = time.monotonic() if now is None else now
        while self._done and self._done[0].at < now - self.window_s:
            self._done.popleft()
        by: dict[tuple[str, str], dict[str, Any]] = {}
        for d in self._done:
            row = by.setdefault((d.app, d.model), {"app": d.app, "model": d.model, "requests": 0, "engine_s": 0.0,
                                                   "tokens": 0, "priority": {}})
            row["requests"] += 1
            row["priority"][d.priority] = row["priority"].get(d.priority, 0) + 1
            row["engine_s"] += d.engine_s
            row["tokens"] += d.tokens
        rows = sorted(by.values(), key=lambda r: -r["engine_s"])
        for r in rows:
            r["engine_s"] = round(r["engine_s"], 2)
        return rows
