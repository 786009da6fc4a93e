"""The tray's menu and icon as plain functions of the daemon's state (no display needed)."""

from pathlib import Path

import pytest

from llmd import service
from llmd.tray.icons import STATES, icon_image
from llmd.tray.menu import build_menu, icon_state, tooltip

STATE = {"active_model": "smollm2-135m", "models": ["gemma3-270m", "smollm2-135m"], "loaded": ["smollm2-135m"],
         "loading": [], "requests_in_flight": 0, "backend": {"name": "llama.cpp", "precision": "gguf"},
         "ttft_p50_ms": 123.4, "tokens_per_s": 61.5, "cache_hit_rate": 0.25}


def test_menu_for_a_running_daemon():
    items = build_menu(STATE, autostart=False)
    texts = [i.text for i in items]
    assert texts[:5] == ["Model: smollm2-135m", "Backend: llama.cpp (gguf)", "TTFT p50: 123 ms", "Tokens/s: 61.5",
                         "Cache hit rate: 25%"]
    assert all(not i.enabled for i in items[:5])  # status lines are greyed
    models = next(i for i in items if i.text == "Models").submenu
    assert [(m.text, m.checked, m.radio, m.action) for m in models] == [
        ("gemma3-270m", False, True, "use:gemma3-270m"), ("smollm2-135m", True, True, "use:smollm2-135m")]
    spec = next(i for i in items if i.text == "Speculation").submenu
    assert [m.text for m in spec] == ["auto", "off", "ngram", "draft"] and spec[0].checked
    assert all(m.enabled and m.action == f"speculation:{m.text}" for m in spec)
    spec = next(i for i in build_menu({**STATE, "speculation": "ngram"}, False) if i.text == "Speculation").submenu
    assert [m.checked for m in spec] == [False, False, True, False]  # the daemon's mode, live
    assert texts[-5:] == ["Open dashboard", "Clear caches", "Stop daemon", "Start at login", "Quit tray"]
    assert items[-2].checked is False
    assert "Loaded: smollm2-135m" in texts


def test_menu_shows_what_is_loaded_and_which_apps_use_it():
    state = {**STATE, "loaded": ["qwen2.5-coder-0.5b", "smollm2-135m"],
             "resident": {"qwen2.5-coder-0.5b": "serving 1 request", "smollm2-135m": "idle 40 s of 5 min"},
             "apps": [{"app": "Continue", "model": "qwen2.5-coder-0.5b", "requests": 12}]}
    texts = [i.text for i in build_menu(state, autostart=False)]
    assert "Loaded: qwen2.5-coder-0.5b, smollm2-135m" in texts
    assert "  qwen2.5-coder-0.5b: serving 1 request" in texts and "  smollm2-135m: idle 40 s of 5 min" in texts
    assert "  Continue → qwen2.5-coder-0.5b: 12 request(s)" in texts


def test_menu_when_stopped_offers_start():
    items = build_menu(None, autostart=True)
    assert [i.text for i in items] == ["llmd is stopped", "Start daemon", "Start at login", "Quit tray"]
    assert items[1].action == "start" and items[2].checked is True


@pytest.mark.parametrize("state,error,want", [
    (None, None, "stopped"), (STATE, None, "idle"), ({**STATE, "loading": ["gemma3-270m"]}, None, "loading"),
    ({**STATE, "requests_in_flight": 2}, None, "generating"), (STATE, "boom", "error")])
def test_icon_state(state, error, want):
    assert icon_state(state, error) == want


def test_each_state_has_its_own_look():
    images = {s: icon_image(s).tobytes() for s in STATES}
    assert len(set(images.values())) == len(STATES)
    assert icon_image("idle").size == (64, 64)


def test_tooltip():
    assert tooltip(None) == "llmd: stopped"
    assert tooltip(STATE) == "llmd: smollm2-135m | llama.cpp gguf | TTFT 123 ms | 62 tok/s"


def test_service_install_uninstall_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("APPDATA", str(tmp_path / "appdata"))
    (tmp_path / "home").mkdir()
    (tmp_path / "appdata").mkdir()
    for platform in ("linux", "darwin", "win32"):
        before = sorted(tmp_path.rglob("*"))
        written = service.install(platform)
        assert written and all(p.exists() for p in written)
        assert service.installed(platform)
        assert "{python}" not in written[0].read_text()
        service.uninstall(platform)
        assert not service.installed(platform)
        assert sorted(tmp_path.rglob("*")) == before, platform  # nothing left behind
