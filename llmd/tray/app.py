"""The tray icon (pystray): shows the daemon's state and steers it through llmd/client.py only.

It follows the daemon's push stream (/llmd/events) on a thread and reconnects when the daemon
goes away; the icon then shows "stopped" and the menu offers Start. Errors from the daemon are
shown as a notification, never a crash. Every icon change is also printed as one JSON line on
stdout ({"icon": state, ...}) so tests and scripts can follow it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import webbrowser
from typing import Any

from llmd import service
from llmd.client import Client, DaemonError, DaemonNotRunning, follow_events
from llmd.config import Settings, load_settings
from llmd.tray.icons import icon_image
from llmd.tray.menu import Item, build_menu, icon_state, tooltip


class TrayApp:
    def __init__(self, settings: Settings) -> None:
        import pystray  # needs a display: imported only when the tray runs

        self._pystray = pystray
        self.settings = settings
        self.client = Client(settings, timeout=300)
        self.state: dict[str, Any] | None = None
        self.error: str | None = None
        self.speculation = "auto"
        self._stop = threading.Event()
        self._shown = ""
        self._spec: tuple[Item, ...] = ()
        self.icon = pystray.Icon("llmd", icon_image("stopped"), "llmd: stopped", menu=self._menu())

    # ---- state ----------------------------------------------------------------------------------

    def on_state(self, state: dict[str, Any]) -> None:
        self.state = state
        self.error = None
        self.refresh()

    def on_down(self, reason: str) -> None:
        if self.state is not None or not self._shown:
            self.state = None
            self.refresh()

    def refresh(self) -> None:
        shown = icon_state(self.state, self.error)
        title = tooltip(self.state)
        if shown != self._shown:
            self.icon.icon = icon_image(shown)
        if title != self.icon.title:
            self.icon.title = title
        spec = self._build()
        if spec != self._spec:  # rebuilding an open menu closes it: only when something in it changed
            self.icon.menu = self._menu(spec)
            self.icon.update_menu()
        if shown != self._shown:
            self._shown = shown
            print(json.dumps({"icon": shown, "model": (self.state or {}).get("active_model")}), flush=True)

    # ---- menu -----------------------------------------------------------------------------------

    def _build(self) -> tuple[Item, ...]:
        return build_menu(self.state, service.installed() if _can_autostart() else False, self.speculation)

    def _menu(self, spec: tuple[Item, ...] | None = None) -> Any:
        self._spec = spec if spec is not None else self._build()
        return self._pystray.Menu(*(self._item(i) for i in self._spec))

    def _item(self, item: Item) -> Any:
        p = self._pystray
        if item.submenu:
            return p.MenuItem(item.text, p.Menu(*(self._item(i) for i in item.submenu)), enabled=item.enabled)
        action = item.action
        return p.MenuItem(
            item.text,
            self._callback(action) if action else None,
            enabled=item.enabled,
            checked=(lambda _item, c=item.checked: c) if item.checked is not None else None,
            radio=item.radio,
        )

    def _callback(self, action: str) -> Any:
        # pystray counts parameters (defaults included) to decide how to call: exactly two here
        def on_click(_icon: Any, _item: Any) -> None:
            self._run(action)

        return on_click

    def _run(self, action: str | None) -> None:
        threading.Thread(target=self._do, args=(action,), daemon=True).start()

    def _do(self, action: str | None) -> None:
        try:
            if action is None:
                return
            if action.startswith("use:"):
                self.client.use(action[4:])
            elif action.startswith("speculation:"):
                self.speculation = self.client.set_speculation(action.split(":", 1)[1])["speculation"]
                self.refresh()
            elif action == "dashboard":
                webbrowser.open(self.settings.base_url + "/")
            elif action == "clear-caches":
                r = self.client.cache_clear(responses=True, prefixes=True)
                self.icon.notify(f"Cleared {r.get('responses_cleared', 0)} replies and "
                                 f"{r.get('prefixes_cleared', 0)} prefixes", "llmd")
            elif action == "start":
                subprocess.Popen([sys.executable, "-m", "llmd", "start"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            elif action == "stop":
                subprocess.run([sys.executable, "-m", "llmd", "stop"], capture_output=True, timeout=60)
            elif action == "toggle-autostart":
                (service.uninstall if service.installed() else service.install)()
                self.refresh()
            elif action == "quit":
                self._stop.set()
                self.icon.stop()
        except (DaemonNotRunning, DaemonError, OSError, RuntimeError) as e:
            self.error = str(e)
            self.refresh()
            try:
                self.icon.notify(str(e), "llmd")
            except Exception:
                pass
            print(json.dumps({"error": str(e)}), flush=True)

    # ---- run ------------------------------------------------------------------------------------

    def run(self) -> None:
        def setup(icon: Any) -> None:
            icon.visible = True
            print(json.dumps({"icon": "stopped", "model": None, "started": True}), flush=True)
            self._shown = "stopped"
            threading.Thread(target=follow_events, name="llmd-tray-events", daemon=True,
                             args=(self.settings, self.on_state, self.on_down, self._stop.is_set)).start()

        self.icon.run(setup=setup)


def _can_autostart() -> bool:
    try:
        service.placements()
        return True
    except RuntimeError:
        return False


def main(argv: list[str] | None = None) -> int:
    settings = load_settings()
    TrayApp(settings).run()
    return 0
