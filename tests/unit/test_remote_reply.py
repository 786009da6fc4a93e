"""The remote relay's reading of an upstream's streamed chat deltas (backends/remote/reply.py)."""

from __future__ import annotations

import pytest

from llmd.backends.remote.reply import Reply, upstream_messages
from llmd.errors import UpstreamError


def _feed(reply: Reply, *deltas: dict) -> list[tuple[str, tuple]]:
    out = []
    for d in deltas:
        out += reply.add({"index": 0, "delta": d})
    return out


def test_reasoning_becomes_a_think_block_and_content_follows():
    r = Reply("http://up", chat=True)
    pieces = _feed(r, {"reasoning_content": "a"}, {"reasoning": "b"}, {"content": "Hi"}, {"content": "!"})
    assert [t for t, _ in pieces] == ["<think>a", "b", "</think>Hi", "!"]
    assert r.end(cut=False) == ("", ())
    open_think = Reply("http://up", chat=True)
    _feed(open_think, {"reasoning_content": "only thinking"})
    assert open_think.end(cut=False)[0] == "</think>"  # closed at the end, nothing left open


def test_calls_are_joined_by_index_and_a_repeated_whole_name_is_not_doubled():
    r = Reply("http://up", chat=True)
    _feed(r, {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_weather", "arguments": '{"ci'}}]},
          {"tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": 'ty": "Oslo"}'}}]},
          {"tool_calls": [{"id": "c2", "function": {"name": "add", "arguments": {"a": 1}}}]})  # no index: by order
    assert r.end(cut=False)[1] == (("c1", "get_weather", '{"city": "Oslo"}'), ("c2", "add", '{"a": 1}'))


def test_a_broken_call_is_an_error_unless_max_tokens_cut_it():
    deltas = [{"content": "x"}, {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]}]
    r = Reply("http://up", chat=True)
    _feed(r, *deltas)
    with pytest.raises(UpstreamError, match="http://up"):
        r.end(cut=False)
    cut = Reply("http://up", chat=True)
    _feed(cut, *deltas)
    assert cut.end(cut=True) == ('{"name": "f", "arguments": {"a"', ())


def test_logprobs_of_both_shapes():
    lp = {"content": [{"token": "Hi", "logprob": -0.5, "top_logprobs": [{"token": "Hi", "logprob": -0.5}]}]}
    chat = Reply("http://up", chat=True).add({"delta": {"content": "Hi"}, "logprobs": lp})
    assert chat == [("Hi", (("Hi", -0.5, (("Hi", -0.5),)),))]
    legacy = {"tokens": ["A", "B"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{"A": -0.1}, {"B": -0.2}]}
    comp = Reply("http://up", chat=False).add({"text": "AB", "logprobs": legacy})
    assert comp == [("AB", (("A", -0.1, (("A", -0.1),)), ("B", -0.2, (("B", -0.2),))))]
    assert Reply("http://up", chat=False).add({"text": "AB", "logprobs": lp})[0][1][0][0] == "Hi"


def test_an_ollama_history_gets_ids_that_pair_results_with_calls():
    history = upstream_messages([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "a", "arguments": "{}"}},
                                                            {"function": {"name": "b", "arguments": "{}"}}]},
        {"role": "tool", "name": "b", "content": "2"}, {"role": "tool", "content": "1"}])
    ids = [c["id"] for c in history[1]["tool_calls"]]
    assert all(ids) and [m["tool_call_id"] for m in history[2:]] == [ids[1], ids[0]]
    given = [{"role": "assistant", "content": "", "tool_calls": [{"id": "x", "function": {"name": "a"}}]},
             {"role": "tool", "tool_call_id": "x", "content": "1"}]
    assert upstream_messages(given) == given  # ids given are left alone


def test_fill_in_the_middle_is_refused_not_sent_as_an_empty_prompt():
    """An upstream got `prompt: ""` for a FIM request and answered it as if it were the code."""
    from llmd.backends.base import FimPrompt, GenerationRequest
    from llmd.backends.remote.reply import request_body
    from llmd.backends.remote.spec import RemoteSpec
    from llmd.errors import BadRequest

    spec = RemoteSpec.from_json('{"urls": ["http://127.0.0.1:1"], "upstream_model": "m"}')
    req = GenerationRequest("r", fim=FimPrompt("def add(a, b):\n    return ", "\n"))
    with pytest.raises(BadRequest, match="fill-in-the-middle") as e:
        request_body(req, spec)
    assert e.value.status == 400
    assert request_body(GenerationRequest("r", prompt="x"), spec)["prompt"] == "x"


def test_tensorrt_refuses_fill_in_the_middle_before_encoding():
    from llmd.backends.base import FimPrompt, GenerationRequest
    from llmd.backends.tensorrt.engine import TensorRTEngine
    from llmd.errors import BadRequest

    engine = TensorRTEngine.__new__(TensorRTEngine)  # no TensorRT-LLM here: only the prompt step runs
    with pytest.raises(BadRequest, match="fill in the middle"):
        engine._prompt_ids(GenerationRequest("r", fim=FimPrompt("x", "y")))
