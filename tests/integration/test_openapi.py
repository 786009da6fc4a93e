"""/openapi.json describes every route, and schemathesis fuzzing it against a real daemon (bounded:
a fixed seed, a few examples per operation) finds no 5xx."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import Daemon

pytestmark = pytest.mark.integration


def test_openapi_lists_every_route_with_its_body(http: httpx.Client):
    spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    paths = spec["paths"]
    for path, method in [("/v1/chat/completions", "post"), ("/v1/responses", "post"), ("/v1/messages", "post"),
                         ("/api/chat", "post"), ("/api/embed", "post"), ("/llmd/status", "get"),
                         ("/v1/responses/{id}", "delete")]:
        assert method in paths[path], (path, method)
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[1]
    assert "messages" in spec["components"]["schemas"][name]["properties"]
    assert paths["/llmd/models/pair"]["post"]["security"] == [{"token": []}]


@pytest.mark.timeout(1200)
def test_schemathesis_finds_no_server_errors(tmp_path: Path):
    exe = shutil.which("schemathesis") or shutil.which("st")
    assert exe, "schemathesis is a test dependency (pip install -e '.[test]')"
    from hub_server import FakeHub, HubServer

    # a small context keeps every reply short, so the run stays bounded; pulls reach a local Hub
    # stand-in with no repos (a fuzzed reference is a 404 there, never a 5xx)
    hub = HubServer(FakeHub()).__enter__()
    d = Daemon(tmp_path / "home", env={"LLMD_CTX": "128", "LLMD_SLOTS": "2", "HF_ENDPOINT": hub.url,
                                       "HF_HOME": str(tmp_path / "hf")}).start()
    try:
        token = (tmp_path / "home" / "config" / "token").read_text().strip()
        out = subprocess.run(
            [exe, "run", d.url + "/openapi.json", "--checks", "not_a_server_error", "-n", "10", "--seed", "7",
             "--phases", "examples,coverage,fuzzing", "--no-shrink", "--request-timeout", "120",
             # a path parameter's generated values are mostly ones no URL can carry: hypothesis then
             # stops with a health check for that operation rather than a finding
             "--suppress-health-check=filter_too_much",
             "-H", f"Authorization: Bearer {token}",
             # the event stream never ends; load/unload churn workers without finding anything new; a
             # delete removes the model the rest needs
             "--exclude-path", "/llmd/events", "--exclude-path", "/llmd/models/load",
             "--exclude-path", "/llmd/models/unload", "--exclude-path", "/api/delete"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)  # its cache dir goes there
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
        assert httpx.get(d.url + "/llmd/health", timeout=10).status_code == 200
    finally:
        d.stop()
        hub.__exit__(None, None, None)
