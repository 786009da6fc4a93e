"""Draft models through the daemon: `llmd models pair`, the vocabulary check, speculation modes
per request and per daemon, and acceptance in `llmd status`."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Daemon, llmd

pytestmark = pytest.mark.integration
NO_STORE = {"Cache-Control": "no-store"}
COPY = "Repeat this code exactly:\ndef add(a, b):\n    total = a + b\n    return total\n"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("pair") / "home"
    daemon = Daemon(home, env={"LLMD_SLOTS": "2", "LLMD_CTX": "1024"})
    daemon.env.pop("LLMD_SPECULATION")  # the real default
    r = llmd(daemon, "quantize", "smollm2-135m", "--type", "F16", "--name", "smol-f16")
    assert r.returncode == 0, r.stderr
    daemon.start()
    yield daemon
    daemon.stop()


def chat(d: Daemon, model: str, **kw) -> httpx.Response:
    return httpx.post(d.url + "/v1/chat/completions", headers=NO_STORE, timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": COPY}], "max_tokens": 40, "temperature": 0, **kw})


def test_pairing_models_with_different_vocabularies_is_refused(d: Daemon):
    r = llmd(d, "models", "pair", "smol-f16", "gemma3-270m")
    assert r.returncode == 1
    assert "vocabularies differ" in r.stderr and "vocabulary sizes differ" in r.stderr, r.stderr
    assert json.loads(llmd(d, "models", "show", "smol-f16", "--json").stdout)["draft"] is None
    r = llmd(d, "models", "pair", "smol-f16", "smol-f16")
    assert r.returncode == 1 and "its own draft" in r.stderr


def test_draft_mode_needs_a_pair(d: Daemon):
    r = chat(d, "smollm2-135m", speculation="draft")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "speculation" and "llmd models pair" in r.json()["error"]["message"]


def test_paired_draft_model_drafts_and_shows_in_status(d: Daemon):
    off = chat(d, "smol-f16", speculation="off")
    assert off.status_code == 200, off.text
    r = llmd(d, "models", "pair", "smol-f16", "smollm2-135m")
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m drafts for smol-f16" in r.stdout
    draft = chat(d, "smol-f16", speculation="draft")
    assert draft.status_code == 200, draft.text
    details = draft.json()["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert draft.json()["choices"][0]["message"]["content"] == off.json()["choices"][0]["message"]["content"]
    st = httpx.get(d.url + "/llmd/status").json()
    m = next(m for m in st["loaded"] if m["name"] == "smol-f16")
    assert m["draft"] == "smollm2-135m"
    assert m["stats"]["speculation"]["draft"]["accepted"] >= details["accepted_prediction_tokens"]
    out = " ".join(llmd(d, "status").stdout.split())  # rich wraps at the terminal's width
    assert ("smol-f16: draft model smollm2-135m (paired with `llmd models pair smol-f16 smollm2-135m`); accepted "
            "drafts: ngram none yet, draft 100% of") in out, out
    assert m["draft_reason"] == "paired with `llmd models pair smol-f16 smollm2-135m`"
    # the draft asked for under its own name: loaded beside, and status says it is a second copy
    assert chat(d, "smollm2-135m", speculation="off").status_code == 200
    loaded = {e["name"]: e for e in httpx.get(d.url + "/llmd/status").json()["loaded"]}
    assert {"smol-f16", "smollm2-135m"} <= set(loaded), loaded.keys()
    copies = loaded["smollm2-135m"]["draft_copies"]
    assert copies.startswith("also loaded as the draft model of smol-f16") and "second copy" in copies, copies
    assert loaded["smol-f16"]["draft_copies"] == ""
    r = llmd(d, "models", "rm", "smollm2-135m")
    assert r.returncode == 1 and "draft model of smol-f16" in r.stderr  # never leaves a dangling pair


def test_the_default_mode_is_auto_and_the_tray_route_changes_it(d: Daemon):
    assert httpx.get(d.url + "/llmd/status").json()["speculation"] == "auto"
    r = chat(d, "smollm2-135m", max_tokens=60)  # no speculation field: the daemon's default applies
    assert r.status_code == 200
    deadline = time.monotonic() + 60  # t(k) is measured when idle; then n-gram drafts on copying
    while not next(m for m in httpx.get(d.url + "/llmd/status").json()["loaded"]
                   if m["name"] == "smollm2-135m")["stats"]["speculation"]["verify_cost_ms"]:
        assert time.monotonic() < deadline, "t(k) was not measured"
        time.sleep(0.2)
    token = (Path(d.env["LLMD_HOME"]) / "config" / "token").read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.post(d.url + "/llmd/speculation", json={"mode": "off"},
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.post(d.url + "/llmd/speculation", json={"mode": "fast"}, headers=auth).status_code == 400

    def drafted(mode: str) -> int:
        assert httpx.post(d.url + "/llmd/speculation", json={"mode": mode}, headers=auth).status_code == 200
        assert httpx.get(d.url + "/llmd/status").json()["speculation"] == mode
        details = chat(d, "smollm2-135m", max_tokens=60).json()["usage"]["completion_tokens_details"]
        return details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]

    try:
        assert drafted("ngram") > 0
        assert drafted("off") == 0
    finally:
        httpx.post(d.url + "/llmd/speculation", json={"mode": "auto"}, headers=auth)


def test_unpair(d: Daemon):
    r = llmd(d, "models", "pair", "smol-f16", "--none")
    assert r.returncode == 0 and "has no draft model" in r.stdout
    assert chat(d, "smol-f16", speculation="draft").status_code == 400
    assert os.path.exists(json.loads(llmd(d, "models", "show", "smol-f16", "--json").stdout)["path"])
    r = llmd(d, "models", "pair", "smol-f16", "--auto")  # back to automatic: none of these is half its size
    assert r.returncode == 0 and "automatically" in r.stdout, r.stdout + r.stderr
    assert llmd(d, "models", "pair", "smol-f16", "smollm2-135m", "--none").returncode == 2

