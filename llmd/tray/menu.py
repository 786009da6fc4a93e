"""The tray menu as plain data, built from the daemon's state by a pure function (unit-tested
without a display); tray/app.py turns it into pystray items."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPECULATION_MODES = ("auto", "off", "ngram", "draft")


@dataclass(frozen=True)
class Item:
    text: str
    action: str | None = None  # what choosing it does: "use:NAME", "dashboard", "start", ...
    enabled: bool = True
    checked: bool | None = None  # None: not a check item
    radio: bool = False
    submenu: tuple[Item, ...] = field(default_factory=tuple)


def icon_state(state: dict[str, Any] | None, error: str | None = None) -> str:
    if error:
        return "error"
    if state is None:
        return "stopped"
    if state.get("loading"):
        return "loading"
    if state.get("requests_in_flight"):
        return "generating"
    return "idle"


def tooltip(state: dict[str, Any] | None) -> str:
    if state is None:
        return "llmd: stopped"
    b = state.get("backend") or {}
    parts = [f"llmd: {state.get('active_model')}", f"{b.get('name', '?')} {b.get('precision', '')}".strip()]
    if state.get("ttft_p50_ms") is not None:
        parts.append(f"TTFT {state['ttft_p50_ms']:.0f} ms")
    if state.get("tokens_per_s") is not None:
        parts.append(f"{state['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def build_menu(state: dict[str, Any] | None, autostart: bool, speculation: str = "auto") -> tuple[Item, ...]:
    """Status lines (greyed), Models, Speculation, Open dashboard, Clear caches, Start/Stop,
    Start at login, Quit. `state` is None when the daemon is not running."""
    items: list[Item] = []
    if state is None:
        items.append(Item("llmd is stopped", enabled=False))
    else:
        b = state.get("backend") or {}
        ttft = state.get("ttft_p50_ms")
        tps = state.get("tokens_per_s")
        hit = state.get("cache_hit_rate")
        items += [
            Item(f"Model: {state.get('active_model')}", enabled=False),
            Item(f"Backend: {b.get('name', '?')} ({b.get('precision', '?')})", enabled=False),
            Item(f"TTFT p50: {'-' if ttft is None else f'{ttft:.0f} ms'}", enabled=False),
            Item(f"Tokens/s: {'-' if tps is None else f'{tps:.1f}'}", enabled=False),
            Item(f"Cache hit rate: {'-' if hit is None else f'{hit:.0%}'}", enabled=False),
        ]
        loaded = state.get("loaded") or []
        items.append(Item(f"Loaded: {', '.join(loaded) if loaded else 'none'}", enabled=False))
        for name, why in (state.get("resident") or {}).items():  # why each stays loaded
            items.append(Item(f"  {name}: {why}", enabled=False))
        for a in state.get("apps") or []:
            items.append(Item(f"  {a['app']} → {a['model']}: {a['requests']} request(s)", enabled=False))
        models = tuple(Item(name, action=f"use:{name}", radio=True, checked=name == state.get("active_model"))
                       for name in state.get("models", []))
        items.append(Item("Models", submenu=models))
        items.append(Item("Speculation", submenu=tuple(
            # the daemon's default for requests that name none; 'draft' needs a paired draft model
            Item(m, action=f"speculation:{m}", radio=True, checked=m == state.get("speculation", speculation))
            for m in SPECULATION_MODES)))
        items.append(Item("Open dashboard", action="dashboard"))
        items.append(Item("Clear caches", action="clear-caches"))
    items.append(Item("Stop daemon", action="stop") if state is not None else Item("Start daemon", action="start"))
    items.append(Item("Start at login", action="toggle-autostart", checked=autostart))
    items.append(Item("Quit tray", action="quit"))
    return tuple(items)
