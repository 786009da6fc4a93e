"""The client libraries apps use, pointed at a real daemon, asserting on what they parse.

Python: openai (sync and async), ollama, anthropic, litellm, langchain-openai, langchain-ollama,
instructor (its default TOOLS mode), pydantic-ai and openai-agents. JavaScript (npm): openai,
ollama and the Vercel AI SDK, run by node from tests/clients_js (installed by
scripts/install-test-deps.sh). The tiny default model does not choose tools well on its own, so
calls are forced (required / a named tool) where the test needs one; `auto` is checked for parsing.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from conftest import Daemon
from pydantic import BaseModel

# the libraries keep HTTP connections in pools that they close at garbage collection, not in the
# test: their ResourceWarnings say nothing about llmd
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list otherwise

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                  "parameters": WEATHER}}]
JS = Path(__file__).resolve().parents[1] / "clients_js"


@pytest.fixture(autouse=True, scope="module")
def _collect_leaked_connections() -> Iterator[None]:
    """Collect the libraries' leftover connections while this module's warning filters apply, not
    during some later test."""
    yield
    gc.collect()


class City(BaseModel):
    name: str
    country: str


def test_openai_sync_tools_embeddings_responses(daemon: Daemon):
    import openai

    c = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                  tools=OPENAI_TOOLS, tool_choice="required", temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    e = c.embeddings.create(model=MODEL, input=["hello", "hello"])
    assert len(e.data[0].embedding) == 576 and e.data[0].embedding == e.data[1].embedding
    first = c.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=10, temperature=0)
    second = c.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                max_output_tokens=10, temperature=0)
    assert first.output_text and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens  # the second turn sees the first
    with c.responses.stream(model=MODEL, input="Say hi", max_output_tokens=8) as s:
        deltas = [ev.delta for ev in s if ev.type == "response.output_text.delta"]
        assert "".join(deltas) == s.get_final_response().output_text


def test_openai_async_stream_and_tool_stream(daemon: Daemon):
    import openai

    async def main() -> tuple[str, list]:
        async with openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused") as c:
            return await chat(c)

    async def chat(c: openai.AsyncOpenAI) -> tuple[str, list]:
        text = ""
        async for ch in await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=8, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
        strict = [{"type": "function", "function": {**OPENAI_TOOLS[0]["function"], "strict": True,  # type: ignore[dict-item]
                                                    "parameters": {**WEATHER, "additionalProperties": False}}}]
        async with c.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                             tools=strict, tool_choice="required") as s:  # type: ignore[arg-type]
            final = await s.get_final_completion()
        return text, final.choices[0].message.tool_calls or []

    text, calls = asyncio.run(main())
    assert text and calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_ollama_python(daemon: Daemon):
    import ollama

    c = ollama.Client(host=daemon.url)
    assert any(m.model == f"{MODEL}:latest" for m in c.list().models)

    def get_weather(city: str) -> str:
        """Weather in a city.

        Args:
          city: the city
        """
        return "sunny"

    # a Python function as a tool is sent and a reply parsed; the call itself is the model's judgement,
    # asserted on the real model (test_real_models.py::test_ollama_chat_tools)
    r = c.chat(model=f"{MODEL}:latest", messages=[{"role": "user", "content": "Say hello."}],
               tools=[get_weather], options={"temperature": 0, "num_predict": 30})
    assert r.message.content and r.done
    e = c.embed(model=MODEL, input=["a", "b"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 576
    assert c.generate(model=MODEL, prompt="Hi", options={"num_predict": 4}).response


def test_anthropic(daemon: Daemon):
    import anthropic

    c = anthropic.Anthropic(base_url=daemon.url, api_key="unused")
    m = c.messages.create(model=MODEL, max_tokens=12, system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
    assert m.content[0].type == "text" and m.content[0].text and m.usage.output_tokens > 0
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    # greedy: sampled at Anthropic's default temperature 1 the tiny model can run a city to the limit
    m = c.messages.create(model=MODEL, max_tokens=80, messages=[{"role": "user", "content": "Weather in Rome?"}],
                          tools=tools, tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    use = [b for b in m.content if b.type == "tool_use"][0]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with c.messages.stream(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "Count"}]) as s:
        text = "".join(s.text_stream)
        assert text == s.get_final_message().content[0].text
    assert c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}]).input_tokens > 1
    # tool search as Claude Code runs it: a deferred tool, found by ToolSearch, whose result is
    # tool_reference blocks (a 400 before: CI, Claude Code's Read task)
    search = {"name": "ToolSearch", "description": "Find deferred tools", "input_schema": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
    deferred = {**tools[0], "defer_loading": True}
    found = c.messages.create(model=MODEL, max_tokens=8, tools=[search, deferred], extra_body={"temperature": 0},
                              messages=[{"role": "user", "content": "Weather in Rome?"},
                                        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                                           "name": "ToolSearch",
                                                                           "input": {"query": "weather"}}]},
                                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                      "content": [{"type": "tool_reference",
                                                                                   "tool_name": "get_weather"}]}]}])
    assert found.content and found.usage.input_tokens > 0


def test_litellm(daemon: Daemon):
    import litellm

    r = litellm.completion(model=f"openai/{MODEL}", api_base=daemon.url + "/v1", api_key="unused",
                           messages=[{"role": "user", "content": "Weather in Rome?"}], tools=OPENAI_TOOLS,
                           tool_choice="required", temperature=0)  # sampled, a city can run to the token limit
    assert r.choices[0].message.tool_calls, r.choices[0]
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    e = litellm.embedding(model=f"openai/{MODEL}", api_base=daemon.url + "/v1", api_key="unused", input=["hello"])
    assert len(e.data[0]["embedding"]) == 576
    o = litellm.completion(model=f"ollama_chat/{MODEL}", api_base=daemon.url,
                           messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert o.choices[0].message.content


def test_langchain_openai(daemon: Daemon):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=MODEL, base_url=daemon.url + "/v1", api_key="unused", temperature=0)  # type: ignore[arg-type]
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER)
    city = llm.with_structured_output(City, method="function_calling").invoke("Name a city and its country")
    assert isinstance(city, City) and city.name
    responses = ChatOpenAI(model=MODEL, base_url=daemon.url + "/v1", api_key="unused",  # type: ignore[arg-type]
                           use_responses_api=True, max_tokens=8)  # type: ignore[call-arg]
    assert responses.invoke("Hi").text
    emb = OpenAIEmbeddings(model=MODEL, base_url=daemon.url + "/v1", api_key="unused",  # type: ignore[arg-type]
                           check_embedding_ctx_length=False)  # send text, not tiktoken ids
    assert len(emb.embed_query("hello")) == 576


def test_langchain_ollama(daemon: Daemon):
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama, OllamaEmbeddings, OllamaLLM

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    # Ollama has no tool_choice, so whether the tiny model calls is its own judgement: the call's shape
    # is asserted on the real model (test_real_models.py); here, that a bound tool still parses a reply
    chat = ChatOllama(model=MODEL, base_url=daemon.url, temperature=0, num_predict=60)
    msg = chat.bind_tools([get_weather]).invoke("Say hello.")
    assert isinstance(msg.content, str) and isinstance(msg.tool_calls, list)
    assert OllamaLLM(model=MODEL, base_url=daemon.url, num_predict=5).invoke("Hi")
    assert len(OllamaEmbeddings(model=MODEL, base_url=daemon.url).embed_query("hello")) == 576


def test_instructor_tools_mode(daemon: Daemon):
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused"),
                                    mode=instructor.Mode.TOOLS)
    city = client.chat.completions.create(model=MODEL, response_model=City, temperature=0, max_retries=1,
                                          messages=[{"role": "user", "content": "Paris is in France. Extract it."}])
    assert isinstance(city, City) and city.name and city.country


def test_pydantic_ai(daemon: Daemon):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=daemon.url + "/v1", api_key="unused"))
    # greedy: sampled at temperature 1 the tiny model once ran a string to the token limit, and the
    # retries that followed overflowed the context
    out = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 200}).run_sync(
        "Paris is in France. Which city is it?").output
    assert isinstance(out, City) and out.name
    # an agent calling a plain tool by itself is the model's judgement: asserted on the real model
    # (test_real_models.py::test_pydantic_ai_calls_the_tool_by_itself)
    result = Agent(model, model_settings={"max_tokens": 30, "temperature": 0}).run_sync("Say hello.")
    assert isinstance(result.output, str) and result.output


def test_openai_agents(daemon: Daemon):
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def main() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused") as client:
            model = OpenAIResponsesModel(model=MODEL, openai_client=client)  # the Agents SDK's default kind
            agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model,
                          model_settings=ModelSettings(tool_choice="required", temperature=0), tool_use_behavior="stop_on_first_tool")
            result = await Runner.run(agent, "What is the weather in Rome?")
            plain = Agent(name="plain", instructions="Be brief.", model=model,
                          model_settings=ModelSettings(max_tokens=300, temperature=0))  # cut short is an error
            return result.final_output, (await Runner.run(plain, "Hi")).final_output

    answer, plain = asyncio.run(main())
    assert calls and answer == f"sunny in {calls[0]}" and plain


def test_javascript_clients(daemon: Daemon):
    """openai and ollama from npm, and the Vercel AI SDK (generateText with a tool, embed)."""
    node = shutil.which("node")
    assert node and (JS / "node_modules").is_dir(), "run scripts/install-test-deps.sh (npm install in tests/clients_js)"
    out = subprocess.run([node, str(JS / "check.mjs"), daemon.url], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["openai_tool"]["name"] == "get_weather"
    jsonschema.validate(json.loads(results["openai_tool"]["arguments"]), WEATHER)
    assert results["openai_embedding_width"] == 576
    assert results["ollama_reply"] and results["ollama_embedding_width"] == 576
    assert results["ai_sdk_tool"]["toolName"] == "get_weather"
    jsonschema.validate(results["ai_sdk_tool"]["input"], WEATHER)
    assert results["ai_sdk_embedding_width"] == 576
