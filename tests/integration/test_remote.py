"""Remote models: llmd in front of real upstream engines on loopback (llama.cpp's llama-server
serving the packaged SmolLM2, and a second llmd daemon), and a stand-in upstream that misbehaves
on purpose. Through llmd's routes, response cache, metrics and status; cancellation reaching the
upstream; failover; the local fallback; errors naming the upstream; keys kept out of the registry
and the log."""

from __future__ import annotations

import contextlib
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
from llmd.tray.menu import build_menu

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
    d = Daemon(tmp_path_factory.mktemp("front") / "home", env={"LLMD_TEST_UPSTREAM_KEY": KEY,
                                                                "LLMD_REMOTE_READ_S": "5"}).start()
    yield d
    d.stop()


def test_chat_and_streams_through_both_apis_cache_metrics_status(front: Daemon, llama_server: LlamaServer,
                                                                request: pytest.FixtureRequest):
    import ollama
    import openai

    r = add_remote(front, "team", llama_server.url)
    assert r.returncode == 0, r.stderr
    assert "(llama-server)" in r.stdout and "smol" in r.stdout
    c = openai.OpenAI(base_url=front.url + "/v1", api_key="unused")
    request.addfinalizer(c.close)
    reply = c.chat.completions.create(model="team", **CHAT)  # type: ignore[call-overload]
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   c.chat.completions.create(model="team", stream=True, **CHAT) if ch.choices)  # type: ignore[call-overload]
    assert text == reply.choices[0].message.content  # greedy: the same reply, streamed
    with ollama.Client(host=front.url) as oc:
        o = oc.chat(model="team", messages=CHAT["messages"], options={"num_predict": 12, "temperature": 0})
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
    # the tray's Models menu lists it, and choosing it there (`llmd use`) makes it the active model
    state = _tray_state(front)
    models = next(i for i in build_menu(state, autostart=False) if i.text == "Models").submenu
    assert "use:team" in {i.action for i in models}
    assert llmd(front, "use", "team").returncode == 0
    try:
        assert _tray_state(front)["active_model"] == "team"
        plain = httpx.post(front.url + "/v1/chat/completions", json=CHAT, timeout=60)  # no model: the active one
        assert plain.json()["model"] == "team" and plain.json()["choices"][0]["message"]["content"] == text
    finally:
        assert llmd(front, "use", "smollm2-135m").returncode == 0


def _tray_state(d: Daemon) -> dict:
    with httpx.stream("GET", d.url + "/llmd/events", timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                return json.loads(line[5:])
    raise AssertionError("no state event")


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
    # the fallback's own tool calls (text in its chat format) are parsed as that model's
    r = httpx.post(front.url + "/v1/chat/completions", timeout=120, json={
        "model": "flaky", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
        "temperature": 0, "max_tokens": 200})
    choice = r.json()["choices"][0]
    assert r.headers["X-LLMD-Fallback"].startswith("smollm2-135m") and choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["tool_calls"][0]["function"]["name"] in ("get_weather", "add")


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


def test_an_upstream_that_stalls_mid_reply_ends_it_with_an_error_naming_it(front: Daemon):
    """LLMD_REMOTE_READ_S (5 s here): an upstream that sends nothing more holds neither the request
    nor its admission forever."""
    import time

    fake = FakeUpstream(mode="stall")
    with ThreadServer(fake.app()) as server:
        try:
            assert add_remote(front, "stalls", server.url).returncode == 0
            t0 = time.monotonic()
            r = httpx.post(front.url + "/v1/chat/completions", json={"model": "stalls", **CHAT, "stream": True},
                           timeout=60)
            took = time.monotonic() - t0
        finally:
            fake.release.set()
    assert r.status_code == 200 and server.url in r.text and "sent nothing for 5 s" in r.text, r.text
    assert 4 < took < 30


def test_an_upstream_slow_to_start_its_reply_is_waited_for_and_not_marked_down(front: Daemon):
    """A long prefill or a queue on a healthy upstream: 8 s before its first chunk, past the 5 s
    between chunks (LLMD_REMOTE_READ_S), well within LLMD_REMOTE_FIRST_TOKEN_S."""
    fake = FakeUpstream(mode="slow_start")
    with ThreadServer(fake.app()) as server:
        assert add_remote(front, "slow-start", server.url).returncode == 0
        for stream in (True, False):
            r = httpx.post(front.url + "/v1/chat/completions", json={"model": "slow-start", **CHAT, "stream": stream},
                           headers={"Cache-Control": "no-store"}, timeout=60)
            assert r.status_code == 200 and "error" not in r.text and "lighthouse" in r.text, r.text
        ups = {m["name"]: m for m in httpx.get(front.url + "/llmd/status").json()["loaded"]}["slow-start"]
        assert all(u["up"] for u in ups["stats"]["upstreams"]), ups


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


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_pass_through_a_remote_llmd_in_every_api(front: Daemon, tmp_path: Path):
    """A second llmd parses its model's calls; the front passes them on structured through its four
    APIs and caches them; a tool result goes back to the upstream with its call's id."""
    import anthropic
    import ollama
    import openai

    other = Daemon(tmp_path / "tooling").start()
    with contextlib.ExitStack() as stack:
        stack.callback(other.stop)
        r = add_remote(front, "tooly", other.url, extra=("--upstream-model", "smollm2-135m"))
        assert r.returncode == 0, r.stderr
        c = stack.enter_context(openai.OpenAI(base_url=front.url + "/v1", api_key="unused"))
        one = {"tools": TOOLS, "temperature": 0, "max_tokens": 200, "parallel_tool_calls": False,
               "tool_choice": "required"}  # one call (a tiny model held to calls repeats them)
        reply = c.chat.completions.create(model="tooly", messages=ASK, **one)  # type: ignore[call-overload]
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
        # the upstream's own answer, passed on whole (the same call the upstream gives directly)
        direct = stack.enter_context(openai.OpenAI(base_url=other.url + "/v1", api_key="unused")).chat.completions.create(
            model="smollm2-135m", messages=ASK, extra_headers={"Cache-Control": "no-store"}, **one)  # type: ignore
        assert json.loads(direct.choices[0].message.tool_calls[0].function.arguments) == json.loads(
            call.function.arguments)
        stream = c.chat.completions.create(model="tooly", messages=ASK, stream=True,  # type: ignore[call-overload]
                                           extra_headers={"Cache-Control": "no-store"}, **one)
        deltas = [tc for ch in stream if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert deltas and deltas[0].index == 0 and deltas[0].function.name in ("get_weather", "add")
        json.loads(deltas[0].function.arguments)
        # a repeat comes from llmd's cache, calls and ids included
        again = httpx.post(front.url + "/v1/chat/completions", timeout=60,
                           json={"model": "tooly", "messages": ASK, **one})
        assert again.headers["X-LLMD-Cache"] == "hit"
        assert again.json()["choices"][0]["message"]["tool_calls"][0]["id"] == call.id
        # Ollama's client (arguments as an object; the tool result names the tool, with no id)
        o = stack.enter_context(ollama.Client(host=front.url))
        history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_name": "get_weather", "content": "sunny, 21 C"}]
        after = o.chat(model="tooly", messages=history, tools=TOOLS, options={"temperature": 0, "num_predict": 20})
        assert after.message.content or after.message.tool_calls
        # Anthropic's Messages API: a tool_use block with the arguments as an object
        a = stack.enter_context(anthropic.Anthropic(base_url=front.url, api_key="unused")).messages.create(
            model="tooly", max_tokens=200, messages=ASK, extra_body={"temperature": 0},  # type: ignore[arg-type]
            tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
        use = next(b for b in a.content if b.type == "tool_use")
        assert a.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
        # the Responses API: a function_call output item
        resp = c.responses.create(model="tooly", input="What is the weather in Paris?", temperature=0,
                                  max_output_tokens=200, tool_choice="required", parallel_tool_calls=False,
                                  tools=[{"type": "function", "name": t["function"]["name"],
                                          "parameters": t["function"]["parameters"], "strict": False}
                                         for t in TOOLS])  # type: ignore[arg-type]
        fc = next(i for i in resp.output if i.type == "function_call")
        assert fc.name in ("get_weather", "add") and isinstance(json.loads(fc.arguments), dict)


def test_reasoning_and_calls_streamed_in_pieces_are_assembled(front: Daemon):
    """An upstream in vLLM's shape: reasoning_content, content, then two calls whose names and
    arguments arrive in fragments with the id only in the first; the upstream's ids are kept."""
    import ollama
    import openai

    fake = FakeUpstream(mode="tools")
    with ThreadServer(fake.app()) as server, openai.OpenAI(base_url=front.url + "/v1", api_key="unused") as c, \
            ollama.Client(host=front.url) as o:
        assert add_remote(front, "vllm-like", server.url).returncode == 0
        m = c.chat.completions.create(model="vllm-like", messages=ASK, tools=TOOLS).choices[0]  # type: ignore[arg-type]
        assert m.finish_reason == "tool_calls" and m.message.content == "Checking."
        assert m.message.model_extra["reasoning_content"] == "The user wants the weather."
        assert [(t.id, t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls] == [
            ("call_up_1", "get_weather", {"city": "Paris", "days": 2}), ("call_up_2", "add", {"a": 1, "b": 2})]
        sent = fake.requests[-1]
        assert sent["tools"] == TOOLS and sent["tool_choice"] == "auto"
        chunks = [ch for ch in c.chat.completions.create(model="vllm-like", messages=ASK, tools=TOOLS,  # type: ignore
                                                         stream=True) if ch.choices]
        calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
        assert [(t.index, t.id, t.function.name) for t in calls] == [(0, "call_up_1", "get_weather"),
                                                                     (1, "call_up_2", "add")]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Checking."
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        got = o.chat(model="vllm-like", messages=ASK, tools=TOOLS)
        assert got.message.thinking == "The user wants the weather." and got.message.content == "Checking."
        assert [t.function.arguments for t in got.message.tool_calls] == [{"city": "Paris", "days": 2},
                                                                          {"a": 1, "b": 2}]
        # a tool result without an id (Ollama's clients name the tool) reaches the upstream with its call's id
        o.chat(model="vllm-like", tools=TOOLS, messages=[
            *ASK, {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
            {"role": "tool", "tool_name": "add", "content": "3"}])
        hist = fake.requests[-1]["messages"]
        ids = [tc["id"] for tc in hist[1]["tool_calls"]]
        assert [h["tool_call_id"] for h in hist[2:]] == [ids[1], ids[0]] and all(ids)
    fake = FakeUpstream(mode="badcall")
    with ThreadServer(fake.app()) as server:
        assert add_remote(front, "badcall", server.url).returncode == 0
        r = httpx.post(front.url + "/v1/chat/completions", json={"model": "badcall", "messages": ASK, "tools": TOOLS},
                       timeout=60)
        assert r.status_code == 200 or r.status_code == 502, r.text
        assert "tool call that llmd cannot pass on" in r.text and server.url in r.text
    fake = FakeUpstream(mode="cutcall")  # the same call cut short by max_tokens: passed on as the text it is
    with ThreadServer(fake.app()) as server:
        assert add_remote(front, "cutcall", server.url).returncode == 0
        r = httpx.post(front.url + "/v1/chat/completions", json={"model": "cutcall", "messages": ASK, "tools": TOOLS},
                       timeout=60)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] == 'Checking.{"name": "get_weather", "arguments": {"city": "Paris"'
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add"]  # the whole one


def test_logprobs_pass_through(front: Daemon, llama_server: LlamaServer, request: pytest.FixtureRequest):
    import openai

    if llmd(front, "models", "show", "team").returncode != 0:
        assert add_remote(front, "team", llama_server.url).returncode == 0
    c = openai.OpenAI(base_url=front.url + "/v1", api_key="unused")
    request.addfinalizer(c.close)
    r = c.chat.completions.create(model="team", messages=CHAT["messages"], max_tokens=8, temperature=0,
                                  logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert "".join(t.token for t in lp) == r.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in lp)
    assert lp[0].top_logprobs[0].logprob >= lp[0].top_logprobs[1].logprob
    chunks = [ch for ch in c.chat.completions.create(model="team", messages=CHAT["messages"], max_tokens=8,
                                                     temperature=0, logprobs=True, top_logprobs=1, stream=True)
              if ch.choices and ch.choices[0].logprobs]
    assert [t.token for ch in chunks for t in ch.choices[0].logprobs.content] == [t.token for t in lp]
    comp = c.completions.create(model="team", prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    assert "".join(comp.choices[0].logprobs.tokens) == comp.choices[0].text
    assert all(len(top) == 2 for top in comp.choices[0].logprobs.top_logprobs)
