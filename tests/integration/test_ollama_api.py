"""The Ollama-compatible API against a real daemon, with raw HTTP and the official client."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

MODEL = "smollm2-135m"
pytestmark = pytest.mark.integration
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


def test_chat_streams_ndjson_by_default(http: httpx.Client):
    with http.stream("POST", "/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                "options": {"temperature": 0, "num_predict": 10}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(not x["done"] for x in lines[:-1])
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] in ("stop", "length")
    assert last["prompt_eval_count"] > 0 and 1 <= last["eval_count"] <= 10
    for k in DURATIONS:
        assert isinstance(last[k], int) and last[k] >= 0
    assert last["total_duration"] >= last["eval_duration"]
    assert "".join(x["message"]["content"] for x in lines)


def test_chat_non_streaming(http: httpx.Client):
    r = http.post("/api/chat", json={"model": MODEL, "stream": False, "messages": [{"role": "user", "content": "Hi"}],
                                     "options": {"temperature": 0, "num_predict": 4}})
    body = r.json()
    assert body["done"] is True and body["done_reason"] == "length" and body["eval_count"] == 4
    assert body["message"]["role"] == "assistant" and body["message"]["content"]


def test_generate_with_stop_and_seed(http: httpx.Client):
    req = {"model": MODEL, "prompt": "Name three fruits.", "stream": False,
           "options": {"temperature": 0.9, "seed": 7, "num_predict": 20}}
    a = http.post("/api/generate", json=req, headers={"Cache-Control": "no-store"}).json()
    b = http.post("/api/generate", json=req, headers={"Cache-Control": "no-store"}).json()
    assert a["response"] == b["response"] and a["response"]
    word = a["response"].split()[1] if len(a["response"].split()) > 1 else a["response"][:2]
    c = http.post("/api/generate", json={**req, "options": {**req["options"], "stop": [word]}}).json()
    assert word not in c["response"] and a["response"].startswith(c["response"])


def test_generate_json_format(http: httpx.Client):
    body = http.post("/api/generate", json={
        "model": MODEL, "prompt": "Reply with a JSON object with the keys name and age of a dog.", "format": "json",
        "stream": False, "options": {"temperature": 0, "num_predict": 400}}).json()
    assert body["done_reason"] == "stop", body
    assert isinstance(json.loads(body["response"]), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
              "required": ["name", "legs"]}
    body = http.post("/api/chat", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Describe a spider."}], "format": schema,
        "stream": False, "options": {"temperature": 0, "num_predict": 200}}).json()
    obj = json.loads(body["message"]["content"])
    assert isinstance(obj["name"], str) and isinstance(obj["legs"], int)


def test_tags_ps_show_version(http: httpx.Client):
    tags = http.get("/api/tags").json()["models"]
    smol = next(m for m in tags if m["name"] == MODEL + ":latest")
    assert smol["details"]["quantization_level"] == "Q4_1" and smol["size"] > 90_000_000
    assert len(smol["digest"]) == 64
    ps = http.get("/api/ps").json()["models"]
    assert [m["name"] for m in ps] == [MODEL + ":latest"]  # named as /api/tags names it
    show = http.post("/api/show", json={"model": MODEL}).json()
    assert "im_start" in show["template"] and show["model_info"]["general.architecture"] == "llama"
    assert http.get("/api/version").json()["version"] >= "0.13.4"  # Codex CLI's --oss needs at least that


def test_official_ollama_client(daemon):
    client = ollama.Client(host=daemon.url)
    try:
        _check_client(client)
    finally:
        client._client.close()


def _check_client(client: ollama.Client) -> None:
    resp = client.chat(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                       options={"temperature": 0, "num_predict": 8})
    assert resp.message.content and resp.done
    streamed = "".join(part.message.content or "" for part in client.chat(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], stream=True,
        options={"temperature": 0, "num_predict": 8}))
    assert streamed == resp.message.content
    gen = client.generate(model=MODEL, prompt="Hello", options={"temperature": 0, "num_predict": 5})
    assert gen.response and gen.eval_count == 5
    assert MODEL + ":latest" in [m.model for m in client.list().models]  # tagged, as Ollama lists them
    assert client.show(MODEL).details.family == "llama"
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404
