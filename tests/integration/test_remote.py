"""Remote models: llmd in front of real upstream engines on loopback (llama.cpp's llama-server
serving the packaged SmolLM2, and a second llmd daemon), and a stand-in upstream that misbehaves
on purpose. Through llmd's routes, response cache, metrics and status; cancellation reaching the
upstream; failover; the local fallback; errors naming the upstream; keys kept out of the registry
and the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Daemon
from peers import LlamaServer
from thread_server import ThreadServer
from upstream_server import REPLY, FakeUpstream

from llmd.models.catalog import find_packaged

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
KEY = "s3cret-upstream-key-0123"
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0}


def llmd(d: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmd", *args], env=d.env, capture_output=True, text=True,
                          timeout=120)


def add_remote(d: Daemon, name: str, *urls: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return llmd(d, "models", "add", "--name", name, *[a for u in urls for a in ("--remote", u)], *extra)


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    s = LlamaServer(find_packaged()["smollm2-135m"], tmp_path_factory.mktemp("llama-server") / "log").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("front") / "home", env={"LLMD_TEST_UPSTREAM_KEY": KEY}).start()
    yield d
    d.stop()


def test_chat_and_streams_through_both_apis_cache_metrics_status(front: Daemon, llama_server: LlamaServer):
    import ollama
    import openai

    r = add_remote(front, "team", llama_server.url)
    assert r.returncode == 0, r.stderr
    assert "(llama-server)" in r.stdout and "smol" in r.stdout
    c = openai.OpenAI(base_url=front.url + "/v1", api_key="unused")
    reply = c.chat.completions.create(model="team", **CHAT)  # type: ignore[call-overload]
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   c.chat.completions.create(model="team", stream=True, **CHAT) if ch.choices)  # type: ignore[call-overload]
    assert text == reply.choices[0].message.content  # greedy: the same reply, streamed
    o = ollama.Client(host=front.url).chat(model="team", messages=CHAT["messages"], options={"num_predict": 12,
                                                                                             "temperature": 0})
    assert o.message.content == text
    comp = httpx.post(front.url + "/v1/completions", json={"model": "team", "prompt": "1, 2, 3,", "max_tokens": 6,
                                                            "temperature": 0}, timeout=60)
    assert comp.status_code == 200 and comp.json()["choices"][0]["text"]
    # a deterministic repeat is answered from llmd's response cache, keyed by the upstream's model
    first = httpx.post(front.url + "/v1/chat/completions", json={"model": "team", **CHAT}, timeout=60)
    again = httpx.post(front.url + "/v1/chat/completions", json={"model": "team", **CHAT}, timeout=60)
    assert again.headers["X-LLMD-Cache"] == "hit" and again.json()["choices"] == first.json()["choices"]
    metrics = httpx.get(front.url + "/metrics").text
    assert 'model="team"' in metrics and "llmd_time_to_first_token_seconds" in metrics
    status = httpx.get(front.url + "/llmd/status").json()
    team = next(m for m in status["loaded"] if m["name"] == "team")
    assert team["engine"] == "remote" and team["kind"] == "llama-server"
    assert team["stats"]["upstreams"][0]["up"] and team["stats"]["upstreams"][0]["served"] >= 2
    assert "remote (llama-server)" in llmd(front, "status").stdout
    # the local model still answers beside it (a remote model holds no local memory)
    assert httpx.post(front.url + "/v1/chat/completions", json=CHAT, timeout=120).status_code == 200
    assert {"team", "smollm2-135m"} <= {m["name"] for m in httpx.get(front.url + "/llmd/status").json()["loaded"]}


def test_cancelling_a_stream_frees_the_upstream_slot(front: Daemon, llama_server: LlamaServer):
    if llmd(front, "models", "show", "team").returncode != 0:
        assert add_remote(front, "team", llama_server.url).returncode == 0
    body = {"model": "team", "prompt": "1, 2, 3, 4,", "max_tokens": 2000, "stream": True, "temperature": 0}
    with httpx.stream("POST", front.url + "/v1/completions", json=body, headers={"Cache-Control": "no-store"},
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert llama_server.processing() == 1  # generating for us (2000 tokens take seconds)
    deadline = time.monotonic() + 10
    while llama_server.processing() != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert llama_server.processing() == 0


def test_failover_when_an_upstream_dies_mid_run(front: Daemon, llama_server: LlamaServer, tmp_path: Path):
    other = Daemon(tmp_path / "other").start()
    try:
        r = add_remote(front, "pair", other.url, llama_server.url, extra=("--upstream-model", "smollm2-135m"))
        assert r.returncode == 0 and "(llmd)" in r.stdout, r.stderr
        body = {"model": "pair", "prompt": "1, 2, 3, 4,", "max_tokens": 400, "stream": True, "temperature": 0}
        lines = []
        with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    other.proc.kill()  # the upstream serving this request dies
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "error" in events[-1] and other.url in events[-1]["error"]["message"], events[-1]
        # new requests go to the upstream that is left
        ok = httpx.post(front.url + "/v1/chat/completions", json={"model": "pair", **CHAT},
                        headers={"Cache-Control": "no-store"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
        ups = next(m for m in httpx.get(front.url + "/llmd/status").json()["loaded"]
                   if m["name"] == "pair")["stats"]["upstreams"]
        assert [u["up"] for u in ups] == [False, True]
        doctor = json.loads(llmd(front, "doctor", "--json").stdout)["remote"]["pair"]
        assert [u["up"] for u in doctor["upstreams"]] == [False, True] and doctor["kind"] == "llmd"
        assert "DOWN" in llmd(front, "doctor").stdout
    finally:
        other.stop()


def test_fallback_to_the_local_model_when_every_upstream_is_down(front: Daemon):
    fake = FakeUpstream()
    with ThreadServer(fake.app()) as server:
        r = add_remote(front, "flaky", server.url, extra=("--fallback", "smollm2-135m"))
        assert r.returncode == 0, r.stderr
        assert httpx.post(front.url + "/v1/chat/completions", json={"model": "flaky", **CHAT},
                          timeout=60).json()["choices"][0]["message"]["content"] == REPLY
    r = httpx.post(front.url + "/v1/chat/completions", json={"model": "flaky", **CHAT, "max_tokens": 6},
                   headers={"Cache-Control": "no-store"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["X-LLMD-Fallback"].startswith("smollm2-135m")
    assert r.json()["choices"][0]["message"]["content"] != REPLY
    assert "answering with the fallback smollm2-135m" in front.log.read_text()


def test_without_a_fallback_every_upstream_down_is_503(front: Daemon):
    fake = FakeUpstream()
    with ThreadServer(fake.app()) as server:
        assert add_remote(front, "gone", server.url).returncode == 0
    r = httpx.post(front.url + "/v1/chat/completions", json={"model": "gone", **CHAT}, timeout=60)
    assert r.status_code == 503 and "no upstream of gone is up" in r.json()["error"]["message"]


@pytest.mark.parametrize("mode, status, words", [("malformed", 502, "malformed event stream"),
                                                   ("error500", 502, "CUDA out of memory"),
                                                   ("truncated", 502, "without finishing the reply")])
def test_a_misbehaving_upstream_is_a_clear_error_and_nothing_is_cached(front: Daemon, mode: str, status: int,
                                                                       words: str):
    fake = FakeUpstream(mode=mode)
    with ThreadServer(fake.app()) as server:
        assert add_remote(front, f"bad-{mode}", server.url).returncode == 0
        for stream in (False, True):
            body = {"model": f"bad-{mode}", **CHAT, "stream": stream}
            r = httpx.post(front.url + "/v1/chat/completions", json=body, timeout=60)
            if stream and r.status_code == 200:  # the error came after the stream began: its last event
                assert words in r.text and server.url in r.text
            else:
                assert r.status_code == status and words in r.json()["error"]["message"], r.text
                assert server.url in r.json()["error"]["message"]
        again = httpx.post(front.url + "/v1/chat/completions", json={"model": f"bad-{mode}", **CHAT}, timeout=60)
        assert again.headers.get("X-LLMD-Cache") != "hit" and again.status_code == status
        assert len(fake.requests) == 3  # each one reached the upstream: nothing was answered from a cache


def test_keys_come_from_the_environment_and_are_never_stored_or_logged(front: Daemon, tmp_path: Path):
    fake = FakeUpstream()
    with ThreadServer(fake.app()) as server:
        r = add_remote(front, "keyed", server.url, extra=("--api-key-env", "LLMD_TEST_UPSTREAM_KEY"))
        assert r.returncode == 0, r.stderr
        reply = httpx.post(front.url + "/v1/chat/completions", json={"model": "keyed", **CHAT}, timeout=60)
        assert reply.status_code == 200
    assert fake.seen_auth and set(fake.seen_auth) == {f"Bearer {KEY}"}
    for f in [*front.home.rglob("*.db"), front.log]:
        assert KEY.encode() not in f.read_bytes(), f
    loose = tmp_path / "key"
    loose.write_text(KEY)
    os.chmod(loose, 0o644)
    r = add_remote(front, "loose", "http://127.0.0.1:9", extra=("--api-key-file", str(loose)))
    assert r.returncode != 0 and "chmod 600" in r.stderr
    r = add_remote(front, "far", "http://10.11.12.13:8000")
    assert r.returncode != 0 and "https" in r.stderr and "--insecure" in r.stderr
