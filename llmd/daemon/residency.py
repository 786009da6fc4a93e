"""Why a loaded model is still loaded, in words for `llmd ps`, /llmd/status and the tray (issue 48:
"show what is resident and why"): its open requests, its keep-alive, and whether a copy of it is
also loaded as another model's draft.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MIB = 1024 * 1024


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def why_resident(users: int, keep_alive: float | None, idle_s: float, short: bool = False) -> str:
    """Why it stays: it serves requests, it is pinned, or it is idle and unloads after its
    keep-alive (or sooner, least recently used first, when a load needs its memory). `short`:
    the first clause only, for the tray."""
    if users:
        return f"serving {users} request{'s' if users != 1 else ''}"
    if keep_alive is None:
        return "pinned (keep_alive -1)" + ("" if short else ": stays until unloaded, whatever else loads")
    if short:
        return f"idle {_duration(idle_s)} of {_duration(keep_alive)}"
    return (f"idle {_duration(idle_s)}; unloads after {_duration(keep_alive)} idle (keep_alive), or sooner "
            "when a load needs its memory (least recently used first)")


def draft_copies(name: str, loaded: Iterable[Mapping[str, Any]]) -> str:
    """When `name` is also loaded as the draft of other loaded models: where, what the copy costs,
    and why it is a copy (empty when it is not)."""
    hosts = [m for m in loaded if m.get("draft") == name and m.get("name") != name]
    if not hosts:
        return ""
    costs = [((m.get("stats") or {}).get("speculation") or {}).get("draft_model", {}).get("rss_load_bytes") for m in hosts]
    cost = sum(c for c in costs if c)
    names = ", ".join(str(m.get("name")) for m in hosts)
    return (f"also loaded as the draft model of {names}"
            + (f" ({cost / MIB:.0f} MiB there)" if cost else "")
            + ": a second copy, because each model runs in its own worker process (a crash or a reload "
            "of one leaves the other serving) and a draft's context holds one sequence per slot of its target")
