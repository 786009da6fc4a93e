from pathlib import Path

import pytest

from llmd.config import load_settings


def test_llmd_home_puts_every_dir_under_one_folder(llmd_home: Path):
    s = load_settings()
    for p in (s.paths.data, s.paths.config, s.paths.cache, s.paths.logs):
        assert Path(p).is_relative_to(llmd_home)


def test_env_and_overrides(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LLMD_PORT", "12345")
    monkeypatch.setenv("LLMD_HOST", "::1")
    s = load_settings()
    assert s.port == 12345 and s.host == "::1"
    assert s.base_url == "http://[::1]:12345"
    assert load_settings({"port": 9}).port == 9


def test_defaults_bind_loopback():
    s = load_settings(env={})
    assert s.host == "127.0.0.1" and s.port == 11435


@pytest.mark.parametrize("var,value", [("LLMD_PORT", "abc"), ("LLMD_PRELOAD", "maybe"), ("LLMD_SLOTS", "0")])
def test_bad_values_are_refused_with_the_variable_named(var: str, value: str):
    with pytest.raises(ValueError) as e:
        load_settings(env={var: value})
    assert var.removeprefix("LLMD_").lower() in str(e.value).lower()
