"""n-gram speculation (prompt lookup) through the API: exact on short contexts under the exact
policy, counted in usage."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import Daemon

pytestmark = pytest.mark.integration
NO_STORE = {"Cache-Control": "no-store"}
CODE = '''def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
'''
PROMPTS = [
    "Repeat this code exactly:\n" + CODE,
    "Summarize in one sentence: The lighthouse was lit in 1821 and automated in 1965.",
    "Tell me about cats.",
    "Reply with a JSON object with the keys name and age of a dog.",
]


def chat(http: httpx.Client, content: str, **kw) -> dict:
    r = http.post("/v1/chat/completions", headers=NO_STORE, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 60, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def exact_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    d = Daemon(tmp_path_factory.mktemp("spec-exact") / "home", env={"LLMD_EXACT": "1", "LLMD_SLOTS": "2"}).start()
    with d.client() as c:
        yield c
    d.stop()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_greedy_equals_off_on_short_contexts(exact_http: httpx.Client, prompt: str):
    off = chat(exact_http, prompt, speculation="off")
    ngram = chat(exact_http, prompt, speculation="ngram")
    assert ngram["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    details = ngram["usage"]["completion_tokens_details"]
    if prompt == PROMPTS[0]:  # copying: drafts from the prompt are taken
        assert details["accepted_prediction_tokens"] > 0, details
    assert off["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    assert off["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] == 0


def test_copying_drafts_and_accepts(http: httpx.Client):
    r = chat(http, PROMPTS[0], speculation="ngram", max_tokens=120)
    d = r["usage"]["completion_tokens_details"]
    assert d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"] > 0  # it drafted
    assert d["accepted_prediction_tokens"] > 0


def test_seeded_sampling_is_the_same_with_ngram(exact_http: httpx.Client):
    http = exact_http
    kw = {"temperature": 0.8, "seed": 11, "max_tokens": 60}
    a = chat(http, "Write a short poem about the sea.", speculation="off", **kw)
    b = chat(http, "Write a short poem about the sea.", speculation="ngram", **kw)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_draft_mode_without_a_paired_model_is_refused(http: httpx.Client):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                "speculation": "draft"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculation"
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                "speculation": "fast"})
    assert r.status_code == 400
