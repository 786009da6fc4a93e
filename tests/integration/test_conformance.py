"""Small conformance points real clients rely on: Ollama tags, JSON null and "" as unset, content
null, a model by id, and JSON errors for unknown routes in each API's shape."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration
MSG = [{"role": "user", "content": "Hi"}]


def test_ollama_latest_tag_names_the_model(http: httpx.Client):
    assert any(m["name"] == "smollm2-135m:latest" for m in http.get("/api/tags").json()["models"])
    r = http.post("/api/chat", json={"model": "smollm2-135m:latest", "messages": MSG, "stream": False,
                                     "options": {"num_predict": 3}})
    assert r.status_code == 200, r.text
    assert http.post("/api/show", json={"model": "smollm2-135m:latest"}).status_code == 200
    loaded = [m["name"] for m in http.get("/llmd/status").json()["loaded"]]
    assert loaded.count("smollm2-135m") == 1 and "smollm2-135m:latest" not in loaded  # one worker, not two


def test_ollama_empty_format_and_null_content_are_unset(http: httpx.Client):
    r = http.post("/api/generate", json={"model": "smollm2-135m", "prompt": "Hi", "format": "", "stream": False,
                                         "options": {"num_predict": 3}})
    assert r.status_code == 200, r.text
    r = http.post("/api/chat", json={"model": "smollm2-135m", "stream": False, "options": {"num_predict": 3},
                                     "messages": [{"role": "assistant", "content": None}, *MSG]})
    assert r.status_code == 200, r.text


def test_openai_null_optional_fields_mean_defaults(http: httpx.Client):
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3, "temperature": None, "top_p": None,
                                                "n": None, "stream": None, "presence_penalty": None, "stop": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_model_by_id(http: httpx.Client):
    r = http.get("/v1/models/smollm2-135m")
    assert r.status_code == 200 and r.json()["id"] == "smollm2-135m" and r.json()["object"] == "model"
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_unknown_routes_answer_json_in_the_api_shape(http: httpx.Client):
    r = http.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.get("/api/nope")
    assert r.status_code == 404 and "no route" in r.json()["error"]
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "does not take GET" in r.json()["error"]["message"]
