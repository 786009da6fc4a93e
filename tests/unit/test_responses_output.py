"""The Responses API's output items as a reply streams: none is left in_progress at the end."""

from __future__ import annotations

from llmd.chat.parse import CallDelta, Delta
from llmd.daemon.routes.responses import _Output
from llmd.daemon.routes.responses_tools import map_tools

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]


def test_a_call_cut_off_while_streaming_ends_incomplete_not_in_progress():
    """A function call streamed as it was decoded whose reply ended inside it (max_output_tokens)
    had its item added and never done: clients waiting for output_item.done hung on it."""
    out = _Output(map_tools(TOOLS))
    events = out.add(Delta(content="Let me check. "))
    events += out.add(Delta(call_deltas=[CallDelta(0, "call_1", "get_weather", '{"city": "Par')]))
    events += out.finish()
    assert [i["status"] for i in out.items] == ["completed", "incomplete"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["type"] for e in done] == ["message", "function_call"]
    assert done[-1]["item"]["arguments"] == '{"city": "Par'


def test_a_finished_call_is_completed_once():
    from llmd.chat.parse import ToolCall

    out = _Output(map_tools(TOOLS))
    events = out.add(Delta(call_deltas=[CallDelta(0, "call_1", "get_weather", "{}")]))
    events += out.add(Delta(tool_calls=[ToolCall("call_1", "get_weather", "{}")]))
    events += out.finish()
    assert [i["status"] for i in out.items] == ["completed"]
    assert sum(e["type"] == "response.output_item.done" for e in events) == 1
