"""The OpenAI-compatible API against a real daemon and the real default model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "smollm2-135m"
pytestmark = pytest.mark.integration


def sse_events(r: httpx.Response) -> list[dict | str]:
    out: list[dict | str] = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_chat_completion_shape_and_usage(http: httpx.Client):
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["prompt_tokens"] > 5 and 1 <= u["completion_tokens"] <= 12
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert "cached_tokens" in u["prompt_tokens_details"]


def test_max_tokens_gives_length(http: httpx.Client):
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_completion_tokens": 5, "temperature": 0})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_streaming_sse_with_usage(http: httpx.Client):
    with http.stream("POST", "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 20,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] >= 1
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    # the same request without streaming gives the same text
    r2 = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 20, "temperature": 0})
    assert r2.json()["choices"][0]["message"]["content"] == text


def test_completions_endpoint(http: httpx.Client):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                                           "temperature": 0})
    body = r.json()
    assert r.status_code == 200, body
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
    with http.stream("POST", "/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 6, "stream": True,
                                                      "temperature": 0}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))


def test_list_models(http: httpx.Client):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert MODEL in [m["id"] for m in body["data"]]


def test_text_parts_are_joined(http: httpx.Client):
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    a = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}], "max_tokens": 8,
                                                "temperature": 0}).json()
    b = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
                                                "temperature": 0}).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_stop_strings_cut_and_never_leak(http: httpx.Client):
    base = {"messages": [{"role": "user", "content": "List the numbers from 1 to 10, separated by commas."}],
            "max_tokens": 40, "temperature": 0}
    full = http.post("/v1/chat/completions", json=base).json()["choices"][0]["message"]["content"]
    assert "5" in full, full
    stop = full[full.index("5"):full.index("5") + 2]
    cut = http.post("/v1/chat/completions", json={**base, "stop": [stop]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == full[: full.index(stop)]
    with http.stream("POST", "/v1/chat/completions", json={**base, "stop": stop, "stream": True}) as r:
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r)
                           if isinstance(e, dict) and e["choices"])
    assert streamed == full[: full.index(stop)]


def test_json_mode_output_parses(http: httpx.Client):
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Reply with a JSON object with the keys name and color of a cat."}],
        "response_format": {"type": "json_object"}, "max_tokens": 200, "temperature": 0})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_json_schema_is_enforced(http: httpx.Client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Invent a person."}], "max_tokens": 300, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}})
    obj = json.loads(r.json()["choices"][0]["message"]["content"])
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int)


def test_temperature_zero_is_deterministic(http: httpx.Client):
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 30, "temperature": 0}
    no_store = {"Cache-Control": "no-store"}  # both runs in the engine, not one from the response cache
    texts = {http.post("/v1/chat/completions", json=body, headers=no_store).json()["choices"][0]["message"]["content"]
             for _ in range(2)}
    assert len(texts) == 1


def test_same_seed_same_text_other_seed_differs(http: httpx.Client):
    body = {"messages": [{"role": "user", "content": "Write a line of a poem."}], "max_tokens": 30,
            "temperature": 1.0, "top_p": 0.95, "seed": 1234}
    no_store = {"Cache-Control": "no-store"}
    a = http.post("/v1/chat/completions", json=body, headers=no_store).json()["choices"][0]["message"]["content"]
    b = http.post("/v1/chat/completions", json=body, headers=no_store).json()["choices"][0]["message"]["content"]
    assert a == b
    others = {http.post("/v1/chat/completions", json={**body, "seed": s}).json()["choices"][0]["message"]["content"]
              for s in (1, 2, 3)}
    assert others - {a}, "three other seeds all gave the same text as seed 1234"


def test_official_openai_client(daemon):
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused") as client:
        _check_client(client)


def _check_client(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=10, temperature=0)
    assert resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens >= 1
    pieces = []
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=10, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == resp.choices[0].message.content
    assert [m.id for m in client.models.list()].count(MODEL) == 1
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
