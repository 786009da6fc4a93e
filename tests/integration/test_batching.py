"""Continuous batching: under the exact policy concurrent greedy requests give the same text as
one at a time; under both policies long prompts do not stall running streams, a full queue
answers 503, and nothing leaks."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import Daemon

pytestmark = pytest.mark.integration

PROMPTS = [
    "Tell me about cats.", "Write a poem about rain.", "Explain gravity to a child.", "Name three rivers in Europe.",
    "What is a prime number?", "Describe a sunset.", "How do bees make honey?", "Give me a tip for cooking rice.",
]


@pytest.fixture(scope="module")
def daemon8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("batch") / "home", env={"LLMD_SLOTS": "8", "LLMD_CTX": "2560",
                                                                "LLMD_RESPONSE_CACHE": "0", "LLMD_EXACT": "1"}).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def fast8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("batch-fast") / "home", env={"LLMD_SLOTS": "8", "LLMD_CTX": "2560",
                                                                     "LLMD_RESPONSE_CACHE": "0"}).start()
    yield d
    d.stop()


@pytest.fixture(params=["fast", "exact"])
def any8(request: pytest.FixtureRequest) -> Daemon:
    return request.getfixturevalue("fast8" if request.param == "fast" else "daemon8")


def complete(url: str, prompt: str, max_tokens: int = 40, speculation: str = "off") -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
        "cache_prompt": False, "speculation": speculation})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def stream_times(url: str, prompt: str, max_tokens: int) -> list[float]:
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                times.append(time.perf_counter())
    return times


def worker_stats(url: str) -> dict:
    return httpx.get(url + "/llmd/status").json()["loaded"][0]


def test_fast_attends_by_matrix_products_and_exact_with_flash_attention_by_default(fast8: Daemon, daemon8: Daemon):
    """LLMD_FLASH_ATTN=auto: the fast policy on the CPU attends by matrix products, the exact one
    keeps llama.cpp's flash-attention kernel (its batch-invariance, this module's equality tests,
    was measured with it)."""
    # in bounded micro-batches: fast8's slots hold 2,560 tokens, so the largest, 512
    assert worker_stats(fast8.url)["attention"] == "matmul (micro-batches of 512)"
    assert worker_stats(daemon8.url)["attention"] == "flash"


def test_matmul_gives_a_seeded_request_the_same_text_warm_as_cold(fast8: Daemon):
    """The same seeded request, cold then with its prompt in the slot. Computing only the prompt's
    last token, alone, took llama.cpp's other kernel and gave it other logits (up to 0.52 away):
    another text from the first token on. prompt_rows.LAST_ROWS computes two."""
    body = {"messages": [{"role": "user", "content": "Write a line of a poem."}], "max_tokens": 30,
            "temperature": 1.0, "top_p": 0.95, "seed": 1234}
    texts = [httpx.post(fast8.url + "/v1/chat/completions", json=body, headers={"Cache-Control": "no-store"},
                        timeout=120).json()["choices"][0]["message"]["content"] for _ in range(3)]
    assert texts[0] == texts[1] == texts[2], texts


def test_on_keeps_flash_attention_under_the_fast_policy(tmp_path: Path):
    d = Daemon(tmp_path / "home", env={"LLMD_CTX": "2560", "LLMD_FLASH_ATTN": "on"}).start()
    try:
        assert worker_stats(d.url)["attention"] == "flash"
        assert complete(d.url, PROMPTS[0]).strip()
    finally:
        d.stop()


@pytest.mark.parametrize("n", [4, 8])
def test_concurrent_greedy_equals_one_at_a_time(daemon8: Daemon, n: int):
    alone = [complete(daemon8.url, p) for p in PROMPTS[:n]]
    with cf.ThreadPoolExecutor(n) as pool:
        together = list(pool.map(lambda p: complete(daemon8.url, p), PROMPTS[:n]))
    assert together == alone


def test_same_text_while_a_long_prompt_is_prefilled(daemon8: Daemon):
    alone = [complete(daemon8.url, p) for p in PROMPTS[:3]]
    long_prompt = "Summarize this: " + "The river flows past the old mill and under the stone bridge. " * 60
    with cf.ThreadPoolExecutor(4) as pool:
        long = pool.submit(complete, daemon8.url, long_prompt, 8)
        time.sleep(0.3)
        together = list(pool.map(lambda p: complete(daemon8.url, p), PROMPTS[:3]))
        assert long.result()
    assert together == alone


def test_off_is_the_same_beside_speculating_requests(daemon8: Daemon):
    """A speculating neighbour puts several rows of its sequence in the step's batch; a request
    with speculation off must still get exactly the text it gets alone."""
    copy = "Repeat this exactly: " + " ".join(f"item{i} = value{i} * {i};" for i in range(30))
    complete(daemon8.url, copy, 20, "ngram")  # the engine measures t(k) when idle after this
    deadline = time.monotonic() + 60
    while not worker_stats(daemon8.url)["stats"]["speculation"]["verify_cost_ms"]:  # then drafts are long
        assert time.monotonic() < deadline, "t(k) was not measured"
        time.sleep(0.2)
    alone = [complete(daemon8.url, p, 60) for p in PROMPTS[:3]]
    with cf.ThreadPoolExecutor(6) as pool:
        spec = [pool.submit(complete, daemon8.url, copy, 150, mode) for mode in ("ngram", "ngram", "auto")]
        time.sleep(1.0)
        together = list(pool.map(lambda p: complete(daemon8.url, p, 60), PROMPTS[:3]))
        assert all(f.result() for f in spec)
    assert together == alone


def _wait_idle(*daemons: Daemon) -> None:
    """No daemon of this module may be busy with idle work (the exact one re-prefills replies)
    while a timing is taken: on two cores it would slow the one measured."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not any((m.get("stats") or {}).get("idle_work")
                   for d in daemons for m in httpx.get(d.url + "/llmd/status").json()["loaded"]):
            return
        time.sleep(0.2)


def test_running_streams_keep_flowing_during_a_long_prefill(any8: Daemon, daemon8: Daemon, fast8: Daemon):
    _wait_idle(daemon8, fast8)
    daemon8 = any8
    long_prompt = "Summarize this: " + "The river flows past the old mill and under the stone bridge. " * 150
    with cf.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_times, daemon8.url, p, 400) for p in PROMPTS[:3]]
        time.sleep(1.5)  # the three streams are decoding
        t_long = time.perf_counter()
        long = pool.submit(complete, daemon8.url, long_prompt, 4)
        long.result()
        t_done = time.perf_counter()
        times = [s.result() for s in streams]
    prefill_s = t_done - t_long
    assert prefill_s > 3, f"the long prompt took only {prefill_s:.1f}s; the test needs a longer prefill"
    for ts in times:
        during = [t for t in ts if t_long <= t <= t_done]
        gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
        # each step prefills at most one 64-token chunk (exact) or the 128-token budget (fast) beside
        # one token for every decoding slot: a stream must never wait for the whole prompt
        assert len(during) >= prefill_s / 2.5, (len(during), prefill_s)
        assert max(gaps) < 2.5, f"a stream stalled {max(gaps):.2f}s during a {prefill_s:.1f}s prefill"


def test_queue_full_is_503_with_retry_after(tmp_path: Path):
    d = Daemon(tmp_path / "q", env={"LLMD_SLOTS": "1", "LLMD_MAX_QUEUE": "1", "LLMD_RESPONSE_CACHE": "0"}).start()
    try:
        body = {"messages": [{"role": "user", "content": "Write a long essay about the sea."}], "max_tokens": 300,
                "temperature": 0}
        with cf.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(httpx.post, d.url + "/v1/chat/completions", json=body, timeout=300)
                       for _ in range(2)]
            time.sleep(1.0)
            r = httpx.post(d.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 503
            assert r.headers["Retry-After"] == "1"
            assert "limit 2" in r.json()["error"]["message"]
            r = httpx.post(d.url + "/api/chat", json={"model": "smollm2-135m", "messages": body["messages"]}, timeout=30)
            assert r.status_code == 503 and "retry" in r.json()["error"]
            assert all(f.result().status_code == 200 for f in running)
        assert httpx.post(d.url + "/v1/chat/completions", json={**body, "max_tokens": 3}, timeout=60).status_code == 200
    finally:
        d.stop()


def test_nothing_leaks_after_200_mixed_requests(any8: Daemon):
    daemon8 = any8
    pid = worker_stats(daemon8.url)["pid"]
    proc = psutil.Process(pid)
    complete(daemon8.url, "warm up", 4)
    rss_before = proc.memory_info().rss

    def one(i: int) -> int:
        kind = i % 4
        body = {"messages": [{"role": "user", "content": f"Request {i}: {PROMPTS[i % 8]}"}], "max_tokens": 6,
                "temperature": 0.7 if i % 3 else 0}
        if kind == 0:  # streamed and abandoned after the first chunk
            with httpx.stream("POST", daemon8.url + "/v1/chat/completions", json={**body, "stream": True,
                                                                                  "max_tokens": 200}, timeout=120) as r:
                next(r.iter_lines())
                return r.status_code
        if kind == 1:  # bad input
            return httpx.post(daemon8.url + "/v1/chat/completions", json={**body, "temperature": "x"}).status_code
        if kind == 2:
            return httpx.post(daemon8.url + "/api/generate", timeout=120, json={
                "model": "smollm2-135m", "prompt": body["messages"][0]["content"], "stream": False,
                "options": {"num_predict": 6}}).status_code
        return httpx.post(daemon8.url + "/v1/chat/completions", json=body, timeout=120).status_code

    with cf.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(200)))
    assert codes.count(400) == 50 and codes.count(200) == 150, codes
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        w = worker_stats(daemon8.url)
        if w["stats"]["slots_busy"] == 0 and w["open_requests"] == 0:
            break
        time.sleep(0.1)
    assert w["stats"]["slots_busy"] == 0 and w["stats"]["waiting"] == 0 and w["open_requests"] == 0, json.dumps(w)
    assert httpx.get(daemon8.url + "/llmd/status").json()["requests_in_flight"] == 0
    growth = proc.memory_info().rss - rss_before
    assert growth < 40 * 1024 * 1024, f"worker RSS grew {growth / 1e6:.1f} MB over 200 requests"


RULES = ("You are the help desk of a small public library. Answer in one short sentence. "
         + " ".join(f"Rule {i}: be polite, be brief and never invent facts about shelf {i}." for i in range(1, 9)))


def chat(url: str, system: str, question: str, max_tokens: int = 24) -> tuple[str, dict]:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


def test_a_shared_system_prompt_is_copied_from_the_slot_that_holds_it(fast8: Daemon):
    """Requests arriving together share a system prompt that one slot holds (too short for the
    prefix cache, under 256 tokens with its reply): one of them takes that slot, the others get
    its KV copied instead of computing it again, and answer from it as well."""
    _, first = chat(fast8.url, RULES, "Hello.")
    system_tokens = first["prompt_tokens"] - 10  # the rules and the template, without the question
    assert 120 < system_tokens and first["prompt_tokens"] + first["completion_tokens"] < 256
    before = worker_stats(fast8.url)["stats"]["kv_copies"]["copies"]
    with cf.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda i: chat(fast8.url, RULES, f"What is the capital of France? ({i})"), range(3)))
    copies = worker_stats(fast8.url)["stats"]["kv_copies"]
    assert copies["copies"] >= before + 1, copies
    for text, usage in got:
        assert usage["prompt_tokens_details"]["cached_tokens"] >= system_tokens, usage
        assert "Paris" in text, got


def test_a_lone_request_never_gives_up_its_first_step(fast8: Daemon):
    """Only a request still on its way to the worker makes a burst's first step yield: the request
    the step is for must not (a flag raised with each request once aborted every lone request's
    first step and waited for a newcomer that never came: 13-38 ms of its first token)."""
    before = worker_stats(fast8.url)["stats"]["joins"]
    for i in range(3):
        text, _ = chat(fast8.url, f"Lone {i}.", "Name a colour.", 8)
        assert text
        time.sleep(0.3)  # idle in between: each request starts a burst
    assert worker_stats(fast8.url)["stats"]["joins"] == before


def test_a_request_sent_moments_after_another_shares_its_first_step(fast8: Daemon):
    """Requests sent together reach the engine tens of milliseconds apart. The first one's step,
    begun alone, is given up when the second arrives within JOIN_S (its KV removed, the abort
    cleaned up), and the next step prefills both: both answer whole, and the worker counts it."""
    long_prompt = "Summarize this: " + "The river flows past the old mill and under the stone bridge. " * 120
    for attempt in range(4):  # the second request must arrive inside the window: a busy machine may miss it
        before = worker_stats(fast8.url)["stats"]["joins"]
        with cf.ThreadPoolExecutor(2) as pool:
            long = pool.submit(chat, fast8.url, f"Attempt {attempt}.", long_prompt, 8)
            time.sleep(0.015)
            short = pool.submit(chat, fast8.url, f"Attempt {attempt}.", "Name a colour.", 8)
            (long_text, long_usage), (short_text, _) = long.result(), short.result()
        assert long_text and short_text
        assert long_usage["prompt_tokens"] > 1200, long_usage
        if worker_stats(fast8.url)["stats"]["joins"] > before:
            break
    else:
        pytest.fail("no step was given up for a request sent 15 ms after another in four tries")
    # the slot's KV is whole after the abort: the same long prompt again is served from it
    _, again = chat(fast8.url, f"Attempt {attempt}.", long_prompt, 8)
    assert again["prompt_tokens_details"]["cached_tokens"] >= long_usage["prompt_tokens"] - 2, again
