"""Bad input gets a 4xx in each API's error shape and changes nothing: a request right after succeeds."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration
OK_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    assert contains in err["message"]
    return err


def still_works(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=OK_CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body,param,contains", [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature", "number"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens", ""),
    ({"messages": "hello"}, "messages", ""),
    ({"messages": []}, "messages", ""),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", ""),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "n=2"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "text parts"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type", ""),
])
def test_bad_fields_are_400_naming_the_field(http: httpx.Client, body: dict, param: str, contains: str):
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param, contains)
    still_works(http)


def test_malformed_json(http: httpx.Client):
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_openai_error(r, 400, None, "not valid JSON")
    r = http.post("/api/chat", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    still_works(http)


def test_unknown_model_is_404_in_both_shapes(http: httpx.Client):
    r = http.post("/v1/chat/completions", json={**OK_CHAT, "model": "gpt-9"})
    err = assert_openai_error(r, 404, "model", "gpt-9")
    assert "smollm2-135m" in err["message"]  # says what is available
    r = http.post("/api/chat", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    still_works(http)


def test_prompt_longer_than_context_gives_both_numbers(http: httpx.Client):
    n_ctx = http.get("/llmd/status").json()["loaded"][0]["n_ctx"]  # automatic: SmolLM2's trained 8192
    long = "word " * (n_ctx + 1000)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]})
    err = assert_openai_error(r, 400, "messages")
    assert err["code"] == "context_length_exceeded" and str(n_ctx) in err["message"]
    n = int(err["message"].split("prompt is ")[1].split()[0])
    assert n > n_ctx
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}], "stream": True})
    assert r.status_code == 400  # streaming requests fail before any event is sent
    r = http.post("/api/generate", json={"model": "smollm2-135m", "prompt": long})
    assert r.status_code == 400 and str(n_ctx) in r.json()["error"]
    still_works(http)


def test_max_tokens_beyond_context_is_an_upper_bound(http: httpx.Client):
    """As llama-server and Ollama: asking more than fits is no error; the reply ends with the context."""
    r = http.post("/v1/chat/completions", json={**OK_CHAT, "max_tokens": 100000})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    r = http.post("/api/chat", json={"model": "smollm2-135m", "stream": False,
                                     "messages": [{"role": "user", "content": "Count from 1 to 500, one per line."}],
                                     "options": {"num_ctx": 96, "num_predict": 1000, "temperature": 0}})
    body = r.json()
    assert r.status_code == 200 and body["done_reason"] == "length", body
    assert body["prompt_eval_count"] + body["eval_count"] <= 96
    still_works(http)


def test_num_ctx_bounds_the_request(http: httpx.Client):
    r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "word " * 100}],
                                     "options": {"num_ctx": 64}})
    assert r.status_code == 400 and "64" in r.json()["error"]
    still_works(http)


def test_foreign_host_header_is_refused(daemon, http: httpx.Client):
    r = httpx.post(daemon.url + "/v1/chat/completions", json=OK_CHAT, headers={"Host": "evil.example:11435"})
    assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
    r = httpx.get(daemon.url + "/api/tags", headers={"Host": "attacker.test"})
    assert r.status_code == 403 and isinstance(r.json()["error"], str)
    r = httpx.post(daemon.url + "/v1/chat/completions", json=OK_CHAT, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    still_works(http)


def test_oversized_body_is_413(http: httpx.Client):
    r = http.post("/v1/chat/completions", content=b"x" * (9 * 1024 * 1024), headers={"content-type": "application/json"})
    assert r.status_code == 413
    still_works(http)
