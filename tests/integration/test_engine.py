"""Engine behaviour through the API: prefix reuse that does not change answers, cancellation,
and recovery from a killed worker."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from conftest import Daemon, computed_again

pytestmark = pytest.mark.integration

SYSTEM = (
    "You are the archivist of the lighthouse museum of Port Elspeth. The museum holds the logbooks of "
    "eleven keepers, from Agnes Morrow, who lit the first lamp in 1821, to Tobias Wren, who switched on "
    "the electric beacon in 1954. Visitors ask about storms, shipwrecks and the keepers' daily routines: "
    "trimming wicks, polishing the Fresnel lens, winding the clockwork that turned the light, and "
    "recording the weather every four hours. The great storm of 1893 drove the schooner Marigold onto "
    "the Skerry Rocks; keeper Elias Dunn rowed out twice and saved nine sailors. In 1907 the lens was "
    "replaced after a crack appeared during a frost. Answer warmly, in two or three sentences, and name "
    "the keeper involved whenever you can. If you do not know, say that the logbooks are silent. The "
    "museum shop sells postcards of the tower, and the tea room serves scones on Sundays from May to "
    "September; mention them only when a visitor asks about them."
)


def chat(http: httpx.Client, messages: list[dict], **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 48, **kw},
                  headers={"Cache-Control": "no-store"})  # test the engine, not the response cache
    assert r.status_code == 200, r.text
    return r.json()


def slots_busy(http: httpx.Client) -> int:
    return sum(m["stats"].get("slots_busy", 0) for m in http.get("/llmd/status").json()["loaded"])


@pytest.fixture(scope="module")
def exact_http(tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(tmp_path_factory.mktemp("exact") / "home", env={"LLMD_EXACT": "1", "LLMD_SLOTS": "2"}).start()
    with d.client() as c:
        yield c
    d.stop()


def test_fast_reuses_a_live_prefix_token_by_token(http: httpx.Client):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who saved the sailors in 1893?"}]
    cold = chat(http, msgs)
    assert 230 <= cold["usage"]["prompt_tokens"] <= 320, cold["usage"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] < 10  # at most the template's first tokens
    again = chat(http, msgs)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (cold["usage"]["prompt_tokens"]
                                                                      - computed_again(str(http.base_url)))
    assert again["choices"][0]["message"]["content"].strip()
    other = chat(http, [msgs[0], {"role": "user", "content": "What happened in 1907?"}])
    cached = other["usage"]["prompt_tokens_details"]["cached_tokens"]
    # everything up to the differing question is reused, not only whole 64-token chunks
    assert other["usage"]["prompt_tokens"] - 20 <= cached < other["usage"]["prompt_tokens"], other["usage"]
    assert other["choices"][0]["message"]["content"].strip()


def test_fast_next_turn_prefills_only_the_new_message(http: httpx.Client):
    msgs = [{"role": "system", "content": SYSTEM + " Today is a quiet day."},
            {"role": "user", "content": "Tell me about the lens."}]
    first = chat(http, msgs, max_tokens=120)
    reply = first["choices"][0]["message"]["content"]
    turn2 = msgs + [{"role": "assistant", "content": reply},
                    {"role": "user", "content": "And who switched on the electric beacon?"}]
    warm = chat(http, turn2)
    u = warm["usage"]
    # the reply's decoded KV is reused as it is: only the end of turn and the new message are new
    assert u["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] + \
        first["usage"]["completion_tokens"] - 4, (u, first["usage"])
    assert u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] <= 30
    assert warm["choices"][0]["message"]["content"].strip()


def test_warm_prefills_without_generating(http: httpx.Client):
    msgs = [{"role": "system", "content": "Warm me first. " + SYSTEM}, {"role": "user", "content": "Who lit the first lamp?"}]
    r = http.post("/llmd/warm", json={"messages": msgs})
    assert r.status_code == 200, r.text
    warm = r.json()
    assert warm["prompt_tokens"] > 200 and warm["cached_tokens"] < 10  # at most the template's first tokens
    zero = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 0})
    assert zero.status_code == 200 and zero.json()["choices"][0]["message"]["content"] == ""
    assert zero.json()["usage"]["completion_tokens"] == 0
    asked = chat(http, msgs)
    assert asked["usage"]["prompt_tokens_details"]["cached_tokens"] == (warm["prompt_tokens"]
                                                                      - computed_again(str(http.base_url)))
    assert http.post("/llmd/warm", json={"prompt": "The keeper said"}).json()["prompt_tokens"] >= 3


def test_fast_anticipates_the_next_turn_header(http: httpx.Client):
    """After a reply (ended by the model or cut at max_tokens), the idle engine prefills the end of
    turn and the next user header: the next turn computes only the user's words and the assistant
    header."""
    msgs = [{"role": "system", "content": SYSTEM + " Be very brief."}, {"role": "user", "content": "Hello!"}]
    first = chat(http, msgs, max_tokens=60)
    time.sleep(0.5)
    turn2 = msgs + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Thanks"}]
    u = chat(http, turn2)["usage"]
    # "Thanks" + "<|im_end|>\n<|im_start|>assistant\n" is about 7 tokens
    assert u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] <= 9, u
    # that prefill was idle work: run at nice 19 and counted (issue 51)
    idle = http.get("/llmd/status").json()["loaded"][0]["stats"]["idle"]
    assert idle["priority"] == "nice 19" and idle["runs"] >= 1 and idle["cpu_s"] > 0, idle


def test_exact_prefix_reuse_gives_the_same_greedy_text(exact_http: httpx.Client):
    http = exact_http
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who saved the sailors in 1893?"}]
    cold = chat(http, msgs)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    warm = chat(http, msgs)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 192
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_exact_next_turn_reuses_the_reply_and_keeps_the_answer(exact_http: httpx.Client):
    http = exact_http
    msgs = [{"role": "system", "content": SYSTEM + " Today is a quiet day."},
            {"role": "user", "content": "Tell me about the lens."}]
    first = chat(http, msgs, max_tokens=120)
    turn2 = msgs + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And who switched on the electric beacon?"}]
    time.sleep(1.0)  # the idle slot re-prefills the reply's whole chunks in the background
    warm = chat(http, turn2)
    cold = chat(http, turn2, cache_prompt=False)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    # more than the first prompt: the reply's chunks were made exact while the slot was idle
    assert cached > first["usage"]["prompt_tokens"], (cached, first["usage"])
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_exact_chunks_are_cut_after_each_end_of_turn(exact_http: httpx.Client):
    """A cut after the user's end-of-turn token: the next request with the same conversation but
    another reply reuses everything up to that token, not only up to the 64-token grid."""
    http = exact_http
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about Agnes Morrow."}]
    chat(http, msgs, max_tokens=4)
    turn = msgs + [{"role": "assistant", "content": "She lit the first lamp."},
                   {"role": "user", "content": "When?"}]
    warm = chat(http, turn)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 64 != 0, cached  # ends right after an end-of-turn token, off the grid


def test_client_disconnect_frees_the_slot(daemon, http: httpx.Client):
    with daemon.client() as c, c.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Write a very long essay about rivers."}],
            "max_tokens": 2000, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()  # kept referenced: a dropped iterator would close the response early
        for _ in range(6):
            next(lines)
        status = http.get("/llmd/status").json()
        assert status["loaded"][0]["stats"]["slots_busy"] == 1, json.dumps(status["loaded"])
    deadline = time.monotonic() + 10
    while slots_busy(http) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slots_busy(http) == 0
    assert chat(http, [{"role": "user", "content": "Hi"}], max_tokens=3)["choices"][0]["message"]["content"]


def test_killed_worker_fails_the_request_then_recovers(daemon, http: httpx.Client):
    pid = http.get("/llmd/status").json()["loaded"][0]["pid"]
    events = []
    with daemon.client() as c, c.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Write a very long essay about mountains."}],
            "max_tokens": 2000, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 4:
                os.kill(pid, signal.SIGKILL)
    errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and errors[0]["error"]["code"] == "engine_crashed"
    assert "killed by signal 9" in errors[0]["error"]["message"]
    # the next request starts a new worker and succeeds
    body = chat(http, [{"role": "user", "content": "Hi"}], max_tokens=3)
    assert body["choices"][0]["message"]["content"]
    status = http.get("/llmd/status").json()
    assert status["loaded"][0]["pid"] != pid and status["worker_crashes"] >= 1


def test_killed_worker_non_streaming_gives_500_then_recovers(daemon, http: httpx.Client):
    import threading

    pid = http.get("/llmd/status").json()["loaded"][0]["pid"]
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    r = http.post("/api/generate", json={"model": "smollm2-135m", "prompt": "Write a long essay about the moon.",
                                         "stream": False, "options": {"temperature": 0, "num_predict": 2000}})
    assert r.status_code == 500 and "killed" in r.json()["error"]
    r = http.post("/api/generate", json={"model": "smollm2-135m", "prompt": "Hi", "stream": False,
                                         "options": {"num_predict": 3}})
    assert r.status_code == 200 and r.json()["done"]



def test_a_worker_that_dies_leaves_no_thread_or_pipe_behind():
    """Each worker handle has a reader and a writer thread and a pipe; when the worker dies, both
    threads end and the pipe is closed (the writer used to wait on its queue for good and the pipe
    stayed open: one thread and one descriptor more per crash, for the daemon's lifetime)."""
    import asyncio

    from llmd.backends.worker import WorkerHandle

    async def main() -> WorkerHandle:
        loop = asyncio.get_running_loop()
        gone = loop.create_future()
        h = WorkerHandle("llama.cpp", None, loop, on_exit=lambda w: gone.done() or gone.set_result(w))
        await asyncio.sleep(0.5)
        os.kill(h.pid, signal.SIGKILL)
        await asyncio.wait_for(gone, 30)
        return h

    h = asyncio.run(main())
    # the reader reports the exit to the loop as its last act: it may still be returning when the
    # loop has run on_exit (the check without this join failed once it was that fast)
    h._reader.join(5)
    h._writer.join(5)
    assert not h._writer.is_alive() and not h._reader.is_alive() and h._conn.closed


def test_status_keeps_the_engines_last_figures_while_it_is_too_slow_to_answer(http: httpx.Client):
    """A worker inside a long step answers status questions late; /llmd/status then shows the last
    figures it gave, saying how old they are, not an empty `stats` (which dropped `threads` from
    `llmd status` and failed a busy-machine test in CI). A stopped process stands in for the long step."""
    http.post("/api/generate", json={"model": "smollm2-135m", "prompt": "Hi", "stream": False,
                                     "options": {"num_predict": 2}})
    fresh = http.get("/llmd/status").json()["loaded"][0]
    assert "threads" in fresh["stats"] and "stale_s" not in fresh["stats"], fresh["stats"]
    os.kill(fresh["pid"], signal.SIGSTOP)
    try:
        late = http.get("/llmd/status").json()["loaded"][0]["stats"]
    finally:
        os.kill(fresh["pid"], signal.SIGCONT)
    assert late["stale_s"] >= 1.5 and late["threads"] == fresh["stats"]["threads"], late
    assert "stale_s" not in http.get("/llmd/status").json()["loaded"][0]["stats"]
