"""The tray on a real virtual display (Xvfb + trayer, pystray's gtk backend in its own D-Bus
session), driven with xdotool as a user would; and the packaging files validated by the tools
the desktops use. Follows ../shared/testing/TRAY.md. In CI these run, never skip."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ARTIFACTS, Daemon

pytestmark = pytest.mark.integration
XTRAY = Path(__file__).resolve().parents[3] / "shared" / "testing" / "xtray.py"
TOOLS = ("Xvfb", "trayer", "xdotool", "import", "dbus-run-session")
MISSING = [t for t in TOOLS if shutil.which(t) is None]
needs_display = pytest.mark.skipif(bool(MISSING) and not os.environ.get("CI"),
                                   reason=f"missing {MISSING}; .ci/run installs them")


class Display:
    def __init__(self) -> None:
        r, w = os.pipe()
        self.xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(w), "-screen", "0", "640x480x24", "-nolisten", "tcp"],
                                     pass_fds=(w,), stderr=subprocess.DEVNULL)
        os.close(w)
        with os.fdopen(r) as f:
            self.display = ":" + f.readline().strip()
        self.env = {**os.environ, "DISPLAY": self.display}
        self.trayer = subprocess.Popen(["trayer", "--edge", "top", "--align", "right", "--widthtype", "request",
                                        "--height", "32", "--SetDockType", "false", "--transparent", "false"],
                                       env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.x("wait-tray", "15")

    def x(self, *args: str) -> str:
        r = subprocess.run([sys.executable, str(XTRAY), *args], env=self.env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, f"xtray {args}: {r.stderr}"
        return r.stdout.strip()

    def xdotool(self, *args: str) -> None:
        subprocess.run(["xdotool", *args], env=self.env, check=True, timeout=30)

    def screenshot(self, path: Path) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        subprocess.run(["import", "-window", "root", str(path)], env=self.env, check=True, timeout=30)

    def close(self) -> None:
        for p in (self.trayer, self.xvfb):
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


class Tray:
    """`llmd tray` in its own session bus and process group; its stdout reports icon changes."""

    def __init__(self, display: Display, daemon: Daemon) -> None:
        env = {**display.env, **daemon.env, "PYSTRAY_BACKEND": "gtk", "NO_AT_BRIDGE": "1",
               "XDG_CONFIG_HOME": str(daemon.home / "xdg")}
        self.proc = subprocess.Popen(["dbus-run-session", "--", sys.executable, "-m", "llmd", "tray"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def wait_for(self, key: str, value: object, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise AssertionError(f"the tray exited: {self.proc.stderr.read() if self.proc.stderr else ''}") from None
                continue
            if msg.get(key) == value:
                return msg
        raise AssertionError(f"the tray never reported {key}={value!r}")

    def dump(self) -> str:
        seen = []
        while not self.lines.empty():
            seen.append(self.lines.get())
        return f"tray said {seen}"

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def display() -> Iterator[Display]:
    d = Display()
    yield d
    d.close()


def open_menu(display: Display) -> None:
    x, y, w, h = map(int, display.x("icon", "20").split())
    display.xdotool("mousemove", str(x + w // 2), str(y + h // 2), "click", "3")
    display.x("menu", "10")


@needs_display
def test_tray_switches_models_and_follows_the_daemon(display: Display, tmp_path: Path):
    daemon = Daemon(tmp_path / "home", env={"LLMD_SLOTS": "1", "LLMD_CTX": "512"}).start()
    tray = Tray(display, daemon)
    try:
        tray.wait_for("icon", "idle")
        time.sleep(1.0)  # let the first burst of state events settle
        for _attempt in range(2):
            open_menu(display)
            display.screenshot(ARTIFACTS / "tray-menu.png")
            # status lines are greyed and skipped: Down lands on Models; Right opens it on gemma3-270m
            display.xdotool("key", "Down", "Right")
            time.sleep(0.5)
            display.xdotool("key", "Return")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if httpx.get(daemon.url + "/llmd/status").json()["active_model"] == "gemma3-270m":
                    break
                time.sleep(0.2)
            else:
                display.xdotool("key", "Escape", "Escape")
                continue
            break
        assert httpx.get(daemon.url + "/llmd/status").json()["active_model"] == "gemma3-270m", tray.dump()
        tray.wait_for("model", "gemma3-270m")
        display.screenshot(ARTIFACTS / "tray-docked.png")

        daemon.stop()
        tray.wait_for("icon", "stopped")
        time.sleep(1.0)
        # Start daemon from the menu: the stopped menu is [status, Start daemon, Start at login, Quit]
        open_menu(display)
        display.xdotool("key", "Down", "Return")
        tray.wait_for("icon", "idle", timeout=120)
        assert httpx.get(daemon.url + "/llmd/health").status_code == 200
    finally:
        tray.close()
        subprocess.run([sys.executable, "-m", "llmd", "stop"], env=daemon.env, capture_output=True, timeout=60)
        daemon.stop()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None and not os.environ.get("CI"),
                    reason="systemd-analyze is not installed; .ci/run installs it")
def test_systemd_unit_verifies(tmp_path: Path):
    from llmd.service import render

    unit = tmp_path / "llmd.service"
    unit.write_text(render("llmd.service.in"))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in r.stderr.splitlines() if "llmd.service" in line]
    assert r.returncode == 0 and not problems, r.stderr


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None and not os.environ.get("CI"),
                    reason="desktop-file-validate is not installed; .ci/run installs it")
def test_desktop_entry_validates(tmp_path: Path):
    from llmd.service import render

    entry = tmp_path / "llmd-tray.desktop"
    entry.write_text(render("llmd-tray.desktop.in"))
    r = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_cli_service_round_trip_leaves_nothing(tmp_path: Path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "HOME": str(tmp_path)}
    before = sorted(tmp_path.rglob("*"))
    r = subprocess.run([sys.executable, "-m", "llmd", "service", "install"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "llmd.service" in r.stdout and "llmd-tray.desktop" in r.stdout
    assert (tmp_path / "cfg/systemd/user/default.target.wants/llmd.service").is_symlink()
    r = subprocess.run([sys.executable, "-m", "llmd", "service", "uninstall"], env=env, capture_output=True, text=True)
    assert r.returncode == 0
    assert sorted(tmp_path.rglob("*")) == before
