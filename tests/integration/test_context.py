"""The context a model is loaded with, and a chat that does not fit it.

The default context is the model's trained one (SmolLM2: 8192 per slot) when memory holds it; on
Ollama's API a chat longer than the context loses its oldest messages as Ollama's does (said in a
header, the status and the metrics), while the OpenAI API keeps its 400; Ollama's num_ctx above the
loaded context loads the model again with a larger one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from conftest import Daemon

pytestmark = pytest.mark.integration

TURN = ("Here is a long note about gardens, rivers, mountains, trains and the weather in spring. " * 6).strip()


def chat(n_turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(n_turns):
        msgs += [{"role": "user", "content": f"Note {i}: {TURN}"}, {"role": "assistant", "content": "Noted."}]
    return msgs + [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("ctx") / "home", env={"LLMD_CTX": "1024", "LLMD_SLOTS": "1"}).start()
    yield d
    d.stop()


def test_the_default_context_is_the_trained_one(http: httpx.Client):
    m = http.get("/llmd/status").json()["loaded"][0]
    assert m["n_ctx"] == 8192 and "trained context" in m["ctx_reason"], m
    assert http.get("/api/ps").json()["models"][0]["context_length"] == 8192


def test_an_embedding_input_longer_than_the_context_is_cut_only_when_asked(small: Daemon):
    with small.client() as http:
        long = "word " * 1500
        r = http.post("/api/embed", json={"model": "smollm2-135m", "input": long, "truncate": False})
        assert r.status_code == 400 and "1024" in r.json()["error"], r.text
        cut = http.post("/api/embed", json={"model": "smollm2-135m", "input": long})  # Ollama's default: cut
        assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == 1024, cut.text
        whole = http.post("/api/embed", json={"model": "smollm2-135m", "input": long[:5000]}).json()
        assert whole["prompt_eval_count"] == 1001  # "word " x 1000 and the BOS: nothing cut below the context


def test_ollama_chat_drops_the_oldest_messages_and_says_so(small: Daemon):
    msgs = chat(12)  # about 1,700 tokens in a 1,024-token context
    with small.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8})
        assert r.status_code == 400 and "1024" in r.json()["error"]["message"]  # OpenAI's API: refused

        r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": msgs, "stream": False,
                                         "options": {"num_predict": 8, "temperature": 0}})
        assert r.status_code == 200, r.text
        dropped = int(r.headers["X-LLMD-Dropped-Messages"])
        body = r.json()
        assert 2 <= dropped < len(msgs) - 2 and body["message"]["content"], (dropped, body)
        # the fewest whole messages: the prompt fits with room to answer, and one message more would
        # have fitted only if it were shorter than a turn
        assert 1024 - 128 - 2 * 90 < body["prompt_eval_count"] <= 1024 - 8, body
        again = http.post("/api/chat", json={"model": "smollm2-135m", "messages": msgs, "stream": False,
                                             "options": {"num_predict": 8, "temperature": 0}})
        # the response cache's replay says what the computed reply said
        assert again.headers["X-LLMD-Cache"] == "hit" and again.headers["X-LLMD-Dropped-Messages"] == str(dropped)

        lines = []
        with http.stream("POST", "/api/chat", json={"model": "smollm2-135m", "messages": msgs,
                                                    "options": {"num_predict": 4, "temperature": 0}}) as s:
            assert s.status_code == 200 and s.headers["X-LLMD-Dropped-Messages"] == str(dropped)
            lines = [json.loads(x) for x in s.iter_lines() if x]
        assert lines[-1]["done"]

        status = http.get("/llmd/status").json()
        assert status["dropped_messages"]["smollm2-135m"] == 2 * dropped
        metrics = http.get("/metrics").text
        assert f'llmd_dropped_messages_total{{api="ollama",backend="llama.cpp",model="smollm2-135m"}} {2 * dropped}.0' \
            in metrics, [x for x in metrics.splitlines() if "dropped" in x]
        # the system message and the newest one alone do not fit: a 400 with the numbers, as before
        r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": TURN * 20}]})
        assert r.status_code == 400 and "left out" in r.json()["error"], r.text


def test_num_ctx_above_the_loaded_context_loads_a_larger_one(small: Daemon):
    long = [{"role": "user", "content": f"{TURN} {TURN} {TURN} {TURN} {TURN} {TURN} Say yes."}]  # ~800 tokens
    with small.client() as http:
        r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": long * 2, "stream": False,
                                         "options": {"num_ctx": 3000, "num_predict": 4}})
        assert r.status_code == 200 and "X-LLMD-Dropped-Messages" not in r.headers, r.text
        assert r.json()["prompt_eval_count"] > 1024  # more than the context it was loaded with
        ps = http.get("/api/ps").json()["models"][0]
        assert ps["context_length"] == 4096, ps  # rounded up, so a num_ctx that creeps up reloads rarely
        m = http.get("/llmd/status").json()["loaded"][0]
        assert "num_ctx" in m["ctx_reason"], m
        pid = m["pid"]
        r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": long, "stream": False,
                                         "options": {"num_ctx": 3500, "num_predict": 4}})
        assert r.status_code == 200 and http.get("/llmd/status").json()["loaded"][0]["pid"] == pid  # no reload
        # the chat that lost its oldest messages in 1,024 tokens fits 4,096 whole: the reply cached
        # from the smaller context is not replayed (the loaded context is in the cache's key)
        r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": chat(12), "stream": False,
                                         "options": {"num_predict": 8, "temperature": 0}})
        assert r.status_code == 200 and r.headers["X-LLMD-Cache"] == "miss", r.headers
        assert "X-LLMD-Dropped-Messages" not in r.headers and r.json()["prompt_eval_count"] > 1024
    log = small.log.read_text()
    assert "again with a context of 4096 tokens per slot (was 1024)" in log
    assert "left out the" in log and "oldest messages" in log  # the dropping test's line: never silent


def test_a_context_sized_by_use_grows_when_a_prompt_needs_it(tmp_path):
    """LLMD_CTX=auto starts a model small (LLMD_CTX_START) and grows its context in place (same
    worker, weights kept) when a prompt needs it, up to the automatic choice (SmolLM2: 8,192): a
    long prompt is answered, not refused, while another request streams beside it (an embedding
    input too, in the model's embedding context); Ollama's chat
    grows rather than loses its oldest messages; what the slots held before a growth is still
    there after it; a prompt beyond the ceiling is a 400 that names both numbers."""
    d = Daemon(tmp_path / "home", env={"LLMD_CTX_START": "2048", "LLMD_SLOTS": "2"}).start()
    try:
        with d.client() as http:
            m = http.get("/llmd/status").json()["loaded"][0]
            assert m["n_ctx"] == 2048 and "grows up to 8192" in m["ctx_reason"], m
            pid = m["pid"]
            # an embedding input longer than the context the model started with: read whole, as the
            # model grows to hold it, not refused (truncate false) nor cut (Ollama's default)
            for truncate in (False, True):
                r = http.post("/api/embed", json={"model": "smollm2-135m", "input": "word " * 3000,
                                                  "truncate": truncate})
                assert r.status_code == 200 and r.json()["prompt_eval_count"] == 3001, r.text
            streamed: list[str] = []

            def stream() -> None:
                with httpx.stream("POST", d.url + "/v1/chat/completions", timeout=300, json={
                        "messages": [{"role": "user", "content": "Count slowly to one hundred."}],
                        "max_tokens": 120, "stream": True}) as r:
                    streamed.extend(x for x in r.iter_lines() if x.startswith("data: "))

            beside = threading.Thread(target=stream)
            beside.start()
            long = chat(20)  # about 2,800 tokens
            r = http.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4})
            beside.join(300)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > 2048, r.json()["usage"]
            assert streamed and streamed[-1] == "data: [DONE]", streamed[-3:]  # the stream beside it finished whole
            m = http.get("/llmd/status").json()["loaded"][0]
            assert m["n_ctx"] == 4096 and m["pid"] == pid, m  # grown in place: no reload
            assert "a prompt needed" in m["ctx_reason"] and "grown in place" in m["ctx_reason"], m
            assert m["memory_estimate"]["n_ctx"] == 4096, m["memory_estimate"]
            r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": chat(40), "stream": False,
                                             "options": {"num_predict": 4}})
            assert r.status_code == 200 and "X-LLMD-Dropped-Messages" not in r.headers, r.text
            assert r.json()["prompt_eval_count"] > 4096
            assert http.get("/llmd/status").json()["loaded"][0]["n_ctx"] == 8192
            r = http.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4},
                          headers={"Cache-Control": "no-store"})  # read before the second growth
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 2048, r.json()["usage"]
            r = http.post("/v1/chat/completions", json={"messages": chat(70), "max_tokens": 4})
            assert r.status_code == 400 and "8192" in r.json()["error"]["message"], r.text
    finally:
        d.stop()
    log = d.log.read_text()
    assert "context grown in place from 2048 to 4096 tokens per slot in" in log, log[-3000:]
    engine_said = (d.home / "logs" / "llmd.log").read_text()  # the workers' lines are in the JSON log
    assert "embedding context grown from 2048 to 4096 tokens: an input needed 3001" in engine_said, engine_said[-3000:]
    assert "loading smollm2-135m again" not in log, log[-3000:]


def test_dropping_keeps_turns_a_strict_template_accepts(tmp_path):
    """Gemma 3's template refuses a history that does not alternate user and model turns: what is
    kept starts at a user message (a cut after an odd number of messages once left a reply first,
    and the request became a 400 although one message more would have fitted)."""
    d = Daemon(tmp_path / "home", env={"LLMD_CTX": "1024", "LLMD_SLOTS": "1", "LLMD_MODEL": "gemma3-270m"}).start()
    try:
        msgs = chat(12)
        msgs[-2]["content"] = "Noted, and here is a longer reply about the weather. " * 8  # an odd cut would fit
        r = httpx.post(d.url + "/api/chat", json={"model": "gemma3-270m", "messages": msgs, "stream": False,
                                                  "options": {"num_predict": 8, "temperature": 0}}, timeout=600)
        assert r.status_code == 200, r.text
        dropped = int(r.headers["X-LLMD-Dropped-Messages"])
        assert dropped >= 2 and dropped % 2 == 0, dropped  # whole user-reply pairs
    finally:
        d.stop()
