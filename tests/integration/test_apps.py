"""What apps call besides plain chat, over raw HTTP against the real daemon: tool calls, embeddings,
the Responses and Anthropic Messages APIs, logprobs, CORS and refused fields. The client-library
tests (test_clients.py) check the same through the libraries apps use."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.integration

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}},
                                               "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat(http: httpx.Client, **body: object) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 80, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_parses_and_validates(http: httpx.Client, choice: object):
    out = _chat(http, tools=TOOLS, tool_choice=choice, max_tokens=400)
    c = out["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    call = c["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    schema = WEATHER if call["function"]["name"] == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_weather"


def test_auto_gives_a_call_or_text_never_raw_json(http: httpx.Client):
    for prompt in ("What is the weather in Paris?", "Tell me a joke."):
        m = _chat(http, tools=TOOLS, messages=[{"role": "user", "content": prompt}])["choices"][0]["message"]
        if m.get("tool_calls"):
            assert m["tool_calls"][0]["function"]["name"] in ("get_weather", "add")
        else:
            assert m["content"] and not m["content"].lstrip().startswith('{"response"')


def test_tool_call_streams_in_openai_delta_shape(http: httpx.Client):
    with http.stream("POST", "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                          "stream": True, "temperature": 0}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls = [tc for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert calls and calls[0]["index"] == 0 and calls[0]["function"]["name"]
    assert json.loads(calls[0]["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_history_round_trip(http: httpx.Client):
    first = _chat(http, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=200)["choices"][0]["message"]
    call = first["tool_calls"][0]
    history = [*ASK, first, {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    out = _chat(http, tools=TOOLS, tool_choice="none", messages=history, max_tokens=30)
    assert out["choices"][0]["message"]["content"] and out["choices"][0]["finish_reason"] in ("stop", "length")


def test_bad_tools_are_400s(http: httpx.Client):
    cases = [({"tools": [{"type": "web_search"}]}, "tools[0]"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
             ({"tools": [TOOLS[0], TOOLS[0]]}, "tools")]
    for body, param in cases:
        r = http.post("/v1/chat/completions", json={"messages": ASK, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text


def test_ollama_tools(http: httpx.Client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    # bounded: greedy, the 135M model can repeat itself to the end of its 8192-token context
    r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": ASK, "tools": tools, "stream": False,
                                     "options": {"temperature": 0, "num_predict": 60}})
    assert r.status_code == 200, r.text  # the call's shape: test_real_models.py::test_ollama_chat_tools
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    r = http.post("/api/chat", json={"model": "smollm2-135m", "messages": history, "tools": tools, "stream": False,
                                     "options": {"temperature": 0, "num_predict": 20}})
    assert r.status_code == 200, r.text
    caps = http.post("/api/show", json={"model": "smollm2-135m"}).json()["capabilities"]
    assert caps == ["completion"]  # its template renders no tools, and it is not an embedding model


def _vec(item: dict) -> list[float]:
    e = item["embedding"]
    if isinstance(e, str):
        raw = base64.b64decode(e)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return e


def test_embeddings_openai(http: httpx.Client):
    r = http.post("/v1/embeddings", json={"model": "smollm2-135m", "input": ["a cat sat on the mat", "tax forms"]})
    assert r.status_code == 200, r.text
    body = r.json()
    width = len(body["data"][0]["embedding"])
    assert width == 576 and [d["index"] for d in body["data"]] == [0, 1]  # SmolLM2-135M's hidden size
    assert abs(sum(x * x for x in body["data"][0]["embedding"]) - 1.0) < 1e-3  # unit length
    assert body["usage"]["prompt_tokens"] > 0
    again = http.post("/v1/embeddings", json={"model": "smollm2-135m", "input": "a cat sat on the mat",
                                              "encoding_format": "base64"})
    assert again.headers["x-llmd-cache"] == "hit"
    assert _vec(again.json()["data"][0]) == pytest.approx(body["data"][0]["embedding"], abs=1e-6)
    tokens = http.post("/v1/embeddings", json={"input": [[1, 2, 3]]})
    assert tokens.status_code == 200 and len(tokens.json()["data"][0]["embedding"]) == width
    bad = http.post("/v1/embeddings", json={"input": "x", "dimensions": 64})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    big = http.post("/v1/embeddings", json={"input": "word " * 9000})
    assert big.status_code == 400 and "tokens" in big.json()["error"]["message"]


def test_embeddings_ollama(http: httpx.Client):
    r = http.post("/api/embed", json={"model": "smollm2-135m", "input": ["hello", "world"]})
    assert r.status_code == 200, r.text
    embs = r.json()["embeddings"]
    assert len(embs) == 2 and len(embs[0]) == 576
    legacy = http.post("/api/embeddings", json={"model": "smollm2-135m", "prompt": "hello"}).json()["embedding"]
    assert legacy == pytest.approx(embs[0], abs=1e-6)
    # truncation is checked in test_context.py on a 1,024-token context: embedding 8,192 tokens of the
    # default context takes 1-2 minutes on two cores


def test_responses_api_two_turns_and_storage(http: httpx.Client):
    r = http.post("/v1/responses", json={"input": "My name is Ada.", "instructions": "Be brief.",
                                         "max_output_tokens": 20, "temperature": 0})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["object"] == "response" and first["output"][0]["type"] == "message"
    assert first["output"][0]["content"][0]["type"] == "output_text"
    second = http.post("/v1/responses", json={"input": "What is my name?", "previous_response_id": first["id"],
                                              "max_output_tokens": 10, "temperature": 0}).json()
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 5  # the first turn is in it
    assert http.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    assert http.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    gone = http.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"
    unstored = http.post("/v1/responses", json={"input": "x", "store": False, "max_output_tokens": 2}).json()
    assert http.get(f"/v1/responses/{unstored['id']}").status_code == 404


def test_responses_api_function_call_and_stream(http: httpx.Client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
    out = http.post("/v1/responses", json={"input": "Weather in Oslo?", "tools": tools, "tool_choice": "required",
                                           "temperature": 0}).json()
    fc = out["output"][0]
    assert fc["type"] == "function_call" and fc["name"] == "get_weather"
    jsonschema.validate(json.loads(fc["arguments"]), WEATHER)
    follow = [{"type": "function_call_output", "call_id": fc["call_id"], "output": "rainy"}]
    with http.stream("POST", "/v1/responses", json={"input": follow, "previous_response_id": out["id"],
                                                    "tools": tools, "stream": True, "max_output_tokens": 15,
                                                    # greedy: sampled, the 135M model may end at once (an
                                                    # empty reply), and this test is about the stream's shape
                                                    "temperature": 0}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = events[-1]["response"]["output"][0]
    assert text and done["content"][0]["text"] == text


def test_responses_api_takes_every_tool_type_codex_sends(http: httpx.Client):
    """Function, namespace and custom tools reach the model; hosted tools are left out and named in
    X-LLMD-Ignored (Codex CLI sends all four kinds)."""
    tools = [{"type": "function", "name": "shell", "description": "Run a command",
              "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
             {"type": "namespace", "name": "multi_agent_v1", "description": "Agents", "tools": [
                 {"type": "function", "name": "spawn_agent", "description": "Start an agent",
                  "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}]},
             {"type": "custom", "name": "apply_patch", "description": "Apply a patch to files"},
             {"type": "web_search"}]
    r = http.post("/v1/responses", json={"input": "Start an agent that tidies the docs.", "tools": tools,
                                         "tool_choice": {"type": "function", "name": "spawn_agent",
                                                         "namespace": "multi_agent_v1"}, "temperature": 0})
    assert r.status_code == 200, r.text
    assert "tools[3] (web_search)" in r.headers["X-LLMD-Ignored"]
    fc = r.json()["output"][0]
    assert (fc["type"], fc["name"], fc["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1"), fc
    jsonschema.validate(json.loads(fc["arguments"]), tools[1]["tools"][0]["parameters"])
    r = http.post("/v1/responses", json={"input": "Fix the typo in README.md.", "tools": tools, "temperature": 0,
                                         "tool_choice": {"type": "custom", "name": "apply_patch"}})
    ctc = r.json()["output"][0]
    assert ctc["type"] == "custom_tool_call" and ctc["name"] == "apply_patch" and isinstance(ctc["input"], str), ctc
    follow = [{"type": "message", "role": "user", "content": "Fix the typo in README.md."},
              {**ctc, "status": "completed"},
              {"type": "custom_tool_call_output", "call_id": ctc["call_id"], "output": "Done: 1 file changed"},
              {**fc}, {"type": "function_call_output", "call_id": fc["call_id"], "output": "agent started"}]
    with http.stream("POST", "/v1/responses", json={"input": follow, "tools": tools, "stream": True,
                                                    "max_output_tokens": 10}) as s:
        kinds = [json.loads(line[6:])["type"] for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200 and kinds[-1] == "response.completed", kinds


def test_anthropic_messages(http: httpx.Client):
    r = http.post("/v1/messages", json={"model": "smollm2-135m", "max_tokens": 20, "system": "Be brief.",
                                        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["type"] == "message" and m["content"][0]["type"] == "text" and m["stop_reason"] in ("end_turn",
                                                                                               "max_tokens")
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    m = http.post("/v1/messages", json={"max_tokens": 200, "messages": ASK, "tools": tools,
                                        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}).json()
    use = m["content"][-1]
    assert m["stop_reason"] == "tool_use" and use["type"] == "tool_use" and use["id"].startswith("toolu_")
    jsonschema.validate(use["input"], WEATHER)
    follow = [*ASK, {"role": "assistant", "content": m["content"]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}]}]
    with http.stream("POST", "/v1/messages", json={"max_tokens": 15, "messages": follow, "tools": tools,
                                                   "stream": True, "temperature": 0}) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    n = http.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert n["input_tokens"] > 1
    bad = http.post("/v1/messages", json={"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["type"] == "error" and "messages[0].role" in bad.text
    # a system entry inside messages (Claude Code sends its environment so) is served
    ok = http.post("/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"},
                                                                       {"role": "system", "content": "Be brief."}]})
    assert ok.status_code == 200, ok.text


def test_logprobs(http: httpx.Client):
    c = _chat(http, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=3,
              max_tokens=5)["choices"][0]
    content = c["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == c["message"]["content"]
    for t in content:  # greedy: the chosen token is the most likely one
        assert t["logprob"] <= 0 and len(t["top_logprobs"]) == 3
        assert t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"], abs=1e-4)
    r = http.post("/v1/completions", json={"prompt": "The capital of France is", "logprobs": 2, "max_tokens": 3,
                                           "temperature": 0}).json()["choices"][0]["logprobs"]
    assert len(r["tokens"]) == 3 and len(r["top_logprobs"][0]) == 2
    bad = http.post("/v1/chat/completions", json={"messages": ASK, "top_logprobs": 2})
    assert bad.status_code == 400


def test_cors_for_allowed_origins_only(http: httpx.Client):
    pre = http.options("/v1/chat/completions", headers={"Origin": "http://localhost:5173",
                                                        "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "http://localhost:5173"
    got = http.get("/v1/models", headers={"Origin": "http://localhost:5173"})
    assert got.headers["access-control-allow-origin"] == "http://localhost:5173"
    evil = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                         "Access-Control-Request-Method": "POST"})
    assert evil.status_code == 403 and "access-control-allow-origin" not in evil.headers


def test_fields_not_done_are_refused_or_named(http: httpx.Client):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "logit_bias": {"42": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "user": "me", "frobnicate": 1})
    assert r.status_code == 200 and r.headers["x-llmd-ignored"] == "frobnicate"


def test_json_schema_replies_are_valid_json(http: httpx.Client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    checked = 0
    for seed in range(4):
        out = _chat(http, messages=[{"role": "user", "content": "Name a city"}], temperature=1.0, seed=seed,
                    max_tokens=120, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        if out["choices"][0]["finish_reason"] == "stop":  # a reply cut at max_tokens is unfinished JSON
            jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)
            checked += 1
    assert checked >= 2, "most replies should end on their own"
