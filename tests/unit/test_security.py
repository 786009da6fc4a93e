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
