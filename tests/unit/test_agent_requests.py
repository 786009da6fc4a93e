"""What coding agents send that used to refuse a whole request: Claude Code's first request,
recorded (tests/data/claude-code-2.1.332-first-request.json, its metadata blanked)."""

import json
from pathlib import Path

import pytest

from llmd.backends.base import Sampling
from llmd.chat.schema import ANY_VALUE, loosen
from llmd.daemon.routes.anthropic import MessagesBody, _sampling, chat_messages
from llmd.errors import BadRequest

RECORDED = Path(__file__).resolve().parents[1] / "data" / "claude-code-2.1.332-first-request.json"


def test_bounds_larger_than_any_reply_are_dropped_and_named():
    schema = {"type": "object", "properties": {"script": {"type": "string", "maxLength": 524288},
                                               "short": {"type": "string", "maxLength": 60},
                                               "description": {"type": "string", "description": "a property"}}}
    grammar, dropped = loosen(schema, "parameters")
    assert dropped == ["parameters.properties.script.maxLength"]
    assert grammar["properties"]["short"]["maxLength"] == 60
    assert grammar["properties"]["description"] == {"type": "string"}  # a property named description stays


def test_a_property_with_no_type_is_any_value():
    grammar, _ = loosen({"type": "object", "properties": {"args": {"description": "anything"}}})
    assert grammar["properties"]["args"] == ANY_VALUE
    assert loosen({})[0] == ANY_VALUE


def test_claude_codes_first_request_as_chat_messages():
    body = json.loads(RECORDED.read_text())
    messages = chat_messages(body["system"], body["messages"])
    # its environment, sent after the user's turn, goes before it: the conversation ends with the user
    assert [m["role"] for m in messages] == ["system", "system", "user"]
    assert messages[1]["content"].startswith("# Environment") and "Reply with just" in messages[2]["content"]
    assert "x-anthropic-billing-header" not in messages[0]["content"]  # changes at every prompt: left out
    assert messages[0]["content"].startswith("You are a Claude agent")


def test_tool_search_results_are_taken_as_the_tools_found():
    """Claude Code's ToolSearch answers with tool_reference blocks; refused, the whole request was a
    400 (CI: three in one run of its Read task)."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "notebook"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "tool_reference", "tool_name": "NotebookEdit"},
                          {"type": "tool_reference", "tool_name": "WebFetch"}]}
    messages = chat_messages(None, [{"role": "user", "content": "Edit the notebook"},
                                    {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}])
    assert messages[-1]["role"] == "tool" and messages[-1]["name"] == "ToolSearch"
    assert messages[-1]["content"].endswith("NotebookEdit, WebFetch")
    odd = {**result, "content": [{"type": "text", "text": "found"}, {"type": "image", "source": {}}]}
    with pytest.raises(BadRequest, match=r"content\[0\]\.content\[1\] is a 'image' block"):
        chat_messages(None, [{"role": "assistant", "content": [use]}, {"role": "user", "content": [odd]}])


def test_every_tool_schema_of_claude_code_becomes_a_grammar():
    pytest.importorskip("llama_cpp")
    from llmd.backends.llamacpp.grammar import grammar_for_tools
    from llmd.chat.formats import ChatFormat
    from llmd.chat.tools import constraint
    from llmd.daemon.routes.anthropic import _tools

    body = json.loads(RECORDED.read_text())
    tools = _tools(body["tools"], None)["tools"]
    c = constraint(ChatFormat(tools="hermes", thinking=False), tools, "required", True)
    assert c is not None and "llmd-call" in grammar_for_tools(c)


def test_a_schema_the_converter_cannot_take_still_holds_the_calls_name_and_shape():
    pytest.importorskip("llama_cpp")
    from llmd.backends.llamacpp.grammar import grammar_for_tools
    from llmd.chat.formats import ChatFormat
    from llmd.chat.tools import constraint

    tools = [{"type": "function", "function": {"name": "odd", "description": "",
                                               "parameters": {"type": "object", "properties": {
                                                   "x": {"type": "no-such-type"}}}}}]
    c = constraint(ChatFormat(tools="hermes", thinking=False), tools, "required", False)
    assert c is not None and c.fallback is not None
    grammar = grammar_for_tools(c)
    assert '"odd"' in grammar.replace('\\"', '"') and "no-such-type" not in grammar


def test_a_stored_reply_keeps_every_parallel_call():
    """A previous_response_id chain rebuilds the history from the stored reply: calls 2..N of a
    parallel reply were lost."""
    from llmd.daemon.routes.responses import _reply_messages

    output = [{"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}", "name": "weather",
               "arguments": json.dumps({"city": city}), "status": "completed"}
              for i, city in enumerate(["Paris", "Oslo", "Lima"])]
    (msg,) = _reply_messages(output)
    assert [json.loads(c["function"]["arguments"])["city"] for c in msg["tool_calls"]] == ["Paris", "Oslo", "Lima"]


def test_sampling_claude_code_leaves_out_is_filled_in_as_llama_server_does():
    """Claude Code's request has no sampling field: the API's temperature with llama-server's tail
    cut, not the 1.5B's whole distribution (which wrote prose about a tool instead of calling it)."""
    body = MessagesBody(**json.loads(RECORDED.read_text()))
    assert _sampling(body) == Sampling(temperature=1.0, top_p=0.95, top_k=40, min_p=0.05)
    sent = MessagesBody(max_tokens=8, messages=[{"role": "user", "content": "hi"}], temperature=0.2, top_k=5, top_p=0.5)
    assert _sampling(sent) == Sampling(temperature=0.2, top_p=0.5, top_k=5, min_p=0.05)
