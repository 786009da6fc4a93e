"""Several apps on one daemon (issue 48): each request gets a priority class and the reason, the
engine serves a higher class first, and status says which app used which model at which class."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from conftest import Daemon

pytestmark = pytest.mark.integration

TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("desktop") / "home", env={"LLMD_SLOTS": "1", "LLMD_RESPONSE_CACHE": "0"}).start()
    yield d
    d.stop()


def _post(d: Daemon, body: dict, headers: dict[str, str]) -> float:
    r = httpx.post(d.url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return time.monotonic()


def test_a_waiting_interactive_request_goes_before_an_agents_turn_that_came_first(one_slot: Daemon):
    """One slot, busy with a long reply; an agent's turn (tools offered) arrives, then a person's
    chat question: when the slot frees, the chat goes first."""
    # a reply held to 1,500 characters or more by its schema: the slot stays busy for seconds
    busy = {"messages": [{"role": "user", "content": "Write a story about a lighthouse."}], "max_tokens": 1200,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "string", "minLength": 1500, "maxLength": 1600}}}}
    agent = {"messages": [{"role": "user", "content": "Read setup.py and tell me what it installs."}],
             "tools": [TOOL], "max_tokens": 30, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    with cf.ThreadPoolExecutor(3) as pool:
        first = pool.submit(_post, one_slot, busy, {"User-Agent": "open-webui/0.6"})
        time.sleep(0.5)
        agent_done = pool.submit(_post, one_slot, agent, {"User-Agent": "claude-cli/2.1"})
        time.sleep(0.3)
        chat_done = pool.submit(_post, one_slot, chat, {"User-Agent": "Continue/1.2"})
        queued = time.monotonic()
        assert first.result() > queued + 0.5, "the first reply ended before the others queued: make it longer"
        assert chat_done.result() < agent_done.result(), "the agent's turn ran before the person's question"
    apps = {a["app"]: a for a in httpx.get(one_slot.url + "/llmd/status").json()["apps"]}
    assert apps["claude-cli"]["priority"] == {"agent": 1}, apps
    assert apps["Continue"]["priority"] == {"interactive": 1}, apps


def test_a_client_sets_its_class_and_a_wrong_one_is_400(one_slot: Daemon):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(one_slot.url + "/v1/chat/completions", json=body, timeout=120,
                   headers={"X-LLMD-Priority": "background", "User-Agent": "indexer/1"})
    assert r.status_code == 200, r.text
    bad = httpx.post(one_slot.url + "/v1/chat/completions", json=body, timeout=60, headers={"X-LLMD-Priority": "now"})
    assert bad.status_code == 400 and "interactive, agent, background" in bad.json()["error"]["message"]
    # or with the body's priority field (Ollama's chat here), which is then no unknown field
    r = httpx.post(one_slot.url + "/api/chat", timeout=120, headers={"User-Agent": "tagger/1"}, json={
        "model": "smollm2-135m", "messages": body["messages"], "options": {"num_predict": 2}, "stream": False,
        "priority": "background"})
    assert r.status_code == 200 and "x-llmd-ignored" not in r.headers, (r.headers, r.text)
    bad = httpx.post(one_slot.url + "/v1/chat/completions", json={**body, "priority": "soon"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
    # embeddings: an indexer's batch is background; a chat embedding the person's question for
    # retrieval may ask for interactive, and is then no unknown field either
    for agent, extra in (("files-indexer/1", {}), ("rag/1", {"priority": "interactive"})):
        r = httpx.post(one_slot.url + "/v1/embeddings", timeout=120, headers={"User-Agent": agent},
                       json={"input": [f"{agent} {uuid.uuid4().hex}"], **extra})
        assert r.status_code == 200 and "x-llmd-ignored" not in r.headers, (r.headers, r.text)
    bad = httpx.post(one_slot.url + "/v1/embeddings", json={"input": "x", "priority": "soon"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
    apps = {a["app"]: a for a in httpx.get(one_slot.url + "/llmd/status").json()["apps"]}
    assert apps["indexer"]["priority"] == {"background": 1}, apps
    assert apps["tagger"]["priority"] == {"background": 1}, apps
    assert apps["files-indexer"]["priority"] == {"background": 1}, apps
    assert apps["rag"]["priority"] == {"interactive": 1}, apps
    assert apps["rag"]["tokens"] > 0 and apps["rag"]["engine_s"] >= 0, apps


# ---- two models, one CPU (backends/cpu_board.py) ----------------------------------------------

CODER = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    from conftest import start_with_models

    d = start_with_models(tmp_path_factory.mktemp("two") / "home",
                          {"LLMD_MAX_LOADED": "0", "LLMD_RESPONSE_CACHE": "0"}, (CODER,))
    yield d
    d.stop()


def _loaded(d: Daemon) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(d.url + "/llmd/status", timeout=30).json()["loaded"]}


def _complete(d: Daemon, prefix: str) -> httpx.Response:
    return httpx.post(d.url + "/infill", timeout=300, json={
        "model": CODER, "input_prefix": prefix, "input_suffix": "\n", "n_predict": 6, "temperature": 0})


def _warm_both(d: Daemon) -> None:
    """Both models loaded and warm, whatever ran before."""
    assert _complete(d, "def half(x):\n    ").status_code == 200
    assert httpx.post(d.url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).status_code == 200


def _agent_reading(d: Daemon, settle_s: float) -> tuple[threading.Thread, dict[str, float]]:
    """An agent's turn with a ~6,000-token prompt sent to SmolLM2 on a thread, returned once its
    prompt has been read for `settle_s`; `agent["done"]` is when it was answered."""
    words = " ".join(f"file{i}.py" for i in range(900))  # about 6,000 tokens
    agent: dict[str, float] = {}

    def agents_turn() -> None:
        r = httpx.post(d.url + "/v1/chat/completions", timeout=600, headers={"User-Agent": "claude-cli/2.1"}, json={
            "model": "smollm2-135m", "max_tokens": 1, "tools": [TOOL],
            "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} Which of these should I read? {words}"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 5000, r.json()["usage"]
        agent["done"] = time.monotonic()

    t = threading.Thread(target=agents_turn)
    t.start()
    deadline = time.monotonic() + 60
    while _loaded(d)["smollm2-135m"]["open_requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(settle_s)  # its prompt is being read
    return t, agent


def test_an_editors_completion_on_one_model_goes_ahead_of_an_agents_long_prompt_on_another(two_models: Daemon):
    """An agent's ~6,000-token prompt is being read on SmolLM2 when the editor asks the coder model
    for a completion: the agent's worker gives its prompt step up and waits (the completion is
    answered before the agent's prompt is read), then goes on; both models stay loaded."""
    d = two_models
    assert _complete(d, "def half(x):\n    ").status_code == 200  # both loaded and warm first
    assert httpx.post(d.url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).status_code == 200
    t, agent = _agent_reading(d, 1.0)
    r = _complete(d, f"# {uuid.uuid4().hex}\ndef double(x: int) -> int:\n    ")
    answered = time.monotonic()
    # held back a moment ago, the agent's worker reads the rest of its prompt in short steps
    # (cpu_board.Turns.step_rows, for CONTENDED_S): another completion would wait less for it. The
    # worker sets them before its next step, which starts once the step it held has finished
    rows = []
    while t.is_alive() and 64 not in rows:
        rows.append(_loaded(d)["smollm2-135m"]["stats"]["prompt_step_rows"])
        time.sleep(0.05)
    t.join()
    rows.append(_loaded(d)["smollm2-135m"]["stats"]["prompt_step_rows"])  # what its last step read
    assert 64 in rows, rows
    assert r.status_code == 200 and r.json()["content"], r.text
    assert answered < agent["done"], (answered, agent["done"])
    loaded = _loaded(d)
    # it held its step where it was (or gave it up), or (the completion arrived between two steps)
    # paused before the next one
    stats = loaded["smollm2-135m"]["stats"]
    assert stats["holds"] + stats["preemptions"] + stats["held_back"] >= 1, stats
    assert set(loaded) == {"smollm2-135m", CODER}


def test_a_persons_chat_takes_the_cpu_from_an_agents_long_prompt_on_the_same_model(two_models: Daemon):
    """An agent's ~6,000-token prompt is being read on SmolLM2 when a person asks the same model a
    question: the prompt's step is given up between graph operations for it (step_watch.py; it
    used to run to its end, 4-6 s on the 1.5B), the chat is answered first, then the agent's
    prompt goes on (from the micro-batches it had finished: none, when the step was one)."""
    d = two_models
    _warm_both(d)
    before = _loaded(d)["smollm2-135m"]["stats"]
    t, agent = _agent_reading(d, 0.5)
    r = httpx.post(d.url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2-135m", "max_tokens": 4,
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} Say hello."}]})
    answered = time.monotonic()
    t.join()
    assert r.status_code == 200, r.text
    assert answered < agent["done"], (answered, agent["done"])
    after = _loaded(d)["smollm2-135m"]["stats"]
    assert after["yields_to_urgent"] > before["yields_to_urgent"], after


def test_a_background_request_finishes_under_a_steady_stream_of_an_editors_completions(two_models: Daemon):
    """Two editors keep the coder model's completions coming back to back while an indexer's
    background request (a ~600-token prompt) waits on SmolLM2: it is held back by class, takes
    short turns for its minimum share (a quarter of LLMD_MIN_SHARE for background work,
    cpu_board.Turns) and finishes while the completions go on being answered."""
    d = two_models
    _warm_both(d)
    before = _loaded(d)["smollm2-135m"]["stats"]["turns"]
    done = threading.Event()
    answered: list[float] = []

    def editor(n: int) -> None:
        while not done.is_set():
            r = _complete(d, f"# {uuid.uuid4().hex}\ndef f{n}_{len(answered)}(x: int) -> int:\n    ")
            assert r.status_code == 200, r.text
            answered.append(time.monotonic())

    editors = [threading.Thread(target=editor, args=(n,)) for n in range(2)]
    for t in editors:
        t.start()
    try:
        time.sleep(1.0)
        # about 600 tokens: strictly by class it took 353 s at 2,000 (a turn now and then: 99 s)
        words = " ".join(f"chunk{i}" for i in range(150))
        r = httpx.post(d.url + "/v1/chat/completions", timeout=600,
                       headers={"X-LLMD-Priority": "background", "User-Agent": "indexer/1"}, json={
                           "model": "smollm2-135m", "max_tokens": 4,
                           "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} Summarize: {words}"}]})
        finished = time.monotonic()
    finally:
        done.set()
        for t in editors:
            t.join()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 500, r.json()["usage"]
    assert any(a > finished - 2.0 for a in answered), "the editors' completions stopped while it ran"
    assert _loaded(d)["smollm2-135m"]["stats"]["turns"] > before, _loaded(d)["smollm2-135m"]["stats"]
