"""Start at login: install or remove the daemon's service and the tray's autostart entry.

Linux: a systemd user unit (enabled by the same symlink `systemctl --user enable` makes) and
an XDG autostart entry. macOS: a launchd agent. Windows: a script in the Startup folder.
Uninstall removes exactly what install wrote and nothing else.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path


@dataclass(frozen=True)
class Placement:
    template: str
    target: Path
    link: Path | None = None  # an enabling symlink to the target


def _xdg_config() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def placements(platform: str | None = None) -> list[Placement]:
    platform = platform or sys.platform
    if platform.startswith("linux"):
        user = _xdg_config() / "systemd" / "user"
        return [
            Placement("llmd.service.in", user / "llmd.service", user / "default.target.wants" / "llmd.service"),
            Placement("llmd-tray.desktop.in", _xdg_config() / "autostart" / "llmd-tray.desktop"),
        ]
    if platform == "darwin":
        return [Placement("com.llmd.daemon.plist.in", Path.home() / "Library/LaunchAgents/com.llmd.daemon.plist")]
    if platform.startswith("win"):
        startup = Path(os.environ.get("APPDATA", Path.home())) / "Microsoft/Windows/Start Menu/Programs/Startup"
        return [Placement("llmd-startup.cmd.in", startup / "llmd-startup.cmd")]
    raise RuntimeError(f"llmd does not know how to start at login on {platform}")


def render(template: str) -> str:
    text = files("llmd").joinpath(f"data/{template}").read_text()
    pythonw = Path(sys.executable).with_name("pythonw.exe")
    return text.replace("{python}", sys.executable).replace(
        "{pythonw}", str(pythonw if pythonw.exists() else sys.executable))


def installed(platform: str | None = None) -> bool:
    return all(p.target.exists() for p in placements(platform))


def install(platform: str | None = None) -> list[Path]:
    written = []
    for p in placements(platform):
        p.target.parent.mkdir(parents=True, exist_ok=True)
        p.target.write_text(render(p.template))
        written.append(p.target)
        if p.link is not None:
            p.link.parent.mkdir(parents=True, exist_ok=True)
            if p.link.is_symlink() or p.link.exists():
                p.link.unlink()
            p.link.symlink_to(p.target)
            written.append(p.link)
    return written


def uninstall(platform: str | None = None) -> list[Path]:
    removed = []
    for p in placements(platform):
        for path in (p.link, p.target):
            if path is not None and (path.is_symlink() or path.exists()):
                path.unlink()
                removed.append(path)
                _prune(path.parent)
    return removed


def _prune(folder: Path) -> None:
    """Remove now-empty folders upward (those install made), stopping at the first non-empty one
    and never going above the config home or the user's home."""
    stops = {_xdg_config().parent, Path.home(), Path(os.environ.get("APPDATA") or Path.home())}
    while folder not in stops and folder != folder.parent:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
