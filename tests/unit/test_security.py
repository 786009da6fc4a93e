import pytest

from llmd.config import load_settings
from llmd.daemon.security import host_allowed, origin_allowed


@pytest.mark.parametrize("host", ["localhost", "localhost:11435", "127.0.0.1:80", "[::1]:11435", "app.localhost:1"])
def test_loopback_hosts_pass(host: str):
    assert host_allowed(host, load_settings(env={}))


@pytest.mark.parametrize("host", ["evil.example", "evil.example:11435", "127.0.0.1.evil.example", "", "10.0.0.2"])
def test_other_hosts_are_refused(host: str):
    assert not host_allowed(host, load_settings(env={}))


def test_bound_address_is_allowed_when_not_loopback():
    assert host_allowed("192.168.1.5:11435", load_settings({"host": "192.168.1.5"}, env={}))


def test_origins():
    s = load_settings(env={})
    assert origin_allowed("http://localhost:3000", s)
    assert origin_allowed("http://127.0.0.1:8080", s)
    assert not origin_allowed("https://evil.example", s)
    assert not origin_allowed("null", s)
    assert origin_allowed("https://app.example", load_settings({"allowed_origins": "https://app.example"}, env={}))


def test_an_empty_or_partial_token_file_is_replaced_never_trusted(tmp_path):
    from llmd.daemon.security import load_or_create_token, token_path

    token_path(tmp_path).write_text("")
    first = load_or_create_token(tmp_path)
    assert len(first) >= 32 and token_path(tmp_path).read_text().strip() == first
    assert load_or_create_token(tmp_path) == first  # a good file is kept
    token_path(tmp_path).write_text(first[:10])  # cut short
    second = load_or_create_token(tmp_path)
    assert second != first[:10] and len(second) >= 32
    assert (token_path(tmp_path).stat().st_mode & 0o777) == 0o600
    assert not list(tmp_path.glob(".token.*"))  # no temp file left behind


def test_stop_never_signals_a_pid_that_is_not_llmd(tmp_path):
    import subprocess
    import sys

    from llmd.cli.daemon import _is_llmd

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not _is_llmd(other.pid)
        home = tmp_path / "home"
        (home / "data").mkdir(parents=True)
        (home / "data" / "llmd.pid").write_text(f"{other.pid}\nhttp://127.0.0.1:1\n")
        r = subprocess.run([sys.executable, "-m", "llmd", "stop"], env={"LLMD_HOME": str(home), "PATH": "/usr/bin"},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "not llmd" in r.stdout and other.poll() is None, r.stdout + r.stderr
    finally:
        other.kill()
        other.wait()
