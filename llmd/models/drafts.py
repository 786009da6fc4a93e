"""Which draft model speculates for a target, and why: set, paired, refused, or chosen by llmd.

No peer pairs a draft by itself; llmd does when a registered GGUF model shares the target's
vocabulary and has at most half its parameters (Qwen2.5-Coder 0.5B for 1.5B: 3.1x fewer). The
engine's cost-aware speculation then drafts with it only while it pays, so an automatic pair
costs nothing where it does not help but the memory it takes (counted in the fit check).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmd.errors import BadRequest
from llmd.models.registry import NO_DRAFT, check_pair

AUTO_DRAFT_RATIO = 2.0  # an automatic draft has at most 1/this of the target's parameters
AUTOMATIC = "paired automatically"


def candidates(rows: list[dict[str, Any]], target: dict[str, Any]) -> list[dict[str, Any]]:
    """Registered GGUF models small enough to draft for `target`, largest first (a larger draft
    agrees with its target more often). Vocabularies are compared by the caller."""
    if target.get("format", "gguf") != "gguf" or not target.get("n_params"):
        return []
    found = [r for r in rows if r["name"] != target["name"] and r.get("format", "gguf") == "gguf"
             and r.get("n_params") and r["n_params"] * AUTO_DRAFT_RATIO <= target["n_params"]
             and r["path"] != target["path"]]
    return sorted(found, key=lambda r: -r["n_params"])


def vocab_compatible(target: dict[str, Any], draft: dict[str, Any]) -> bool:
    try:
        check_pair(target, draft)
        return True
    except BadRequest:
        return False


def choose_draft(target: dict[str, Any], rows: list[dict[str, Any]], configured: str | None, auto: bool,
                 compatible: Callable[[dict[str, Any], dict[str, Any]], bool]) -> tuple[dict[str, Any] | None, str]:
    """(draft row or None, why). In order: LLMD_DRAFT (`configured`; BadRequest when it cannot
    draft), `llmd models pair`, a refusal (`--none`), then the largest compatible candidate
    unless `auto` is off. Reads vocabularies: call it off the event loop."""
    by_name = {r["name"]: r for r in rows}
    if configured is not None:
        draft = by_name.get(configured) or by_name.get(configured.removesuffix(":latest"))
        if draft is None:
            from llmd.errors import ModelNotFound

            raise ModelNotFound(f"LLMD_DRAFT names {configured!r}, which is not registered", "draft")
        if not compatible(target, draft):
            check_pair(target, draft)  # raises, naming what differs
        return draft, "set by LLMD_DRAFT"
    if target.get("draft"):
        return by_name[target["draft"]], f"paired with `llmd models pair {target['name']} {target['draft']}`"
    if target.get("draft") == NO_DRAFT:
        return None, f"refused with `llmd models pair {target['name']} --none`"
    if not auto:
        return None, "automatic pairing is off (LLMD_AUTO_DRAFT=0)"
    for cand in candidates(rows, target):
        if compatible(target, cand):
            return cand, (f"{AUTOMATIC}: it shares the vocabulary and has {target['n_params'] / cand['n_params']:.1f}x "
                          f"fewer parameters; it drafts only while that pays (`llmd models pair {target['name']} "
                          "--none` refuses it)")
    return None, "no registered model shares its vocabulary at half its size or less"
