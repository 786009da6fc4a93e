"""llmd.chat: format detection, tool history rendering, constraints and reply parsing.

The templates here are small ones written for the test in each vendor's style (the markers
and variables the real templates use); the packaged SmolLM2 template is the real thing."""

from __future__ import annotations

import json

import pytest

from llmd.chat.formats import ChatFormat, detect
from llmd.chat.parse import ReplyParser, parse_calls
from llmd.chat.template import ChatTemplate
from llmd.chat.tools import constraint, generic_messages, native_messages

HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>"
          "{% endfor %}{% if tools %}Respond with {\"name\": function name, \"parameters\": ...}{% endif %}"
          "<|python_tag|>")
MISTRAL = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}{% if tools %}[AVAILABLE_TOOLS]" \
          "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
GEMMA = "{% if tools %}<start_function_declaration>{% endif %}<start_function_call>" \
        "{% for m in messages %}{{ m.content }}{% endfor %}"
THINKING = HERMES.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "",
                                           "parameters": {"type": "object",
                                                          "properties": {"a": {"type": "integer"}}}}}]


def test_detect_formats():
    from llmd.models.catalog import find_packaged
    from llmd.models.gguf import read_gguf

    assert detect(HERMES).tools == "hermes"
    assert detect(LLAMA3).tools == "llama3"
    assert detect(MISTRAL).tools == "mistral"
    assert detect(GEMMA).tools == "gemma"
    assert detect(None) == ChatFormat("generic", False)
    assert detect(THINKING).thinking
    smol = read_gguf(find_packaged()["smollm2-135m"]).chat_template
    assert detect(smol) == ChatFormat("generic", False)  # its template never reads tools


def test_native_history_renders_calls_with_object_arguments():
    fmt = detect(HERMES)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rainy"}]
    text = ChatTemplate(HERMES, "", "").render(native_messages(fmt, history), tools=TOOLS)
    # an object, its keys in the order the call gave them (transformers' tojson, not Jinja's sorted one)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert '"name": "add"' in text and "rainy" in text


def test_mistral_ids_are_nine_alphanumerics():
    msgs = native_messages(detect(MISTRAL), [{"role": "assistant", "tool_calls": [
        {"id": "call_abcdef0123", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_abcdef0123", "content": "x"}])
    cid = msgs[0]["tool_calls"][0]["id"]
    assert len(cid) == 9 and cid.isalnum() and msgs[1]["tool_call_id"] == cid


def test_generic_history_describes_tools_and_merges_user_turns():
    msgs = generic_messages([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                             {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "2"},
                             {"role": "user", "content": "Thanks"}], TOOLS, "auto")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be kind.") and '"name": "get_weather"' in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}
    assert "Result of add:\n2" in msgs[3]["content"] and msgs[3]["content"].endswith("Thanks")


def test_constraints_per_format_and_choice():
    generic, hermes = detect(None), detect(HERMES)
    auto = constraint(generic, TOOLS, "auto", True)
    assert auto is not None and len(auto.schema["anyOf"]) == 2  # a call or an answer
    named = constraint(generic, TOOLS, "add", False)
    assert named is not None
    calls = named.schema["properties"]["tool_calls"]
    assert calls["maxItems"] == 1 and calls["items"]["properties"]["name"] == {"const": "add"}
    # native auto: the model chooses freely, and a call it starts is held to the tools (a lazy grammar)
    lazy = constraint(hermes, TOOLS, "auto", True)
    assert lazy is not None and lazy.trigger == "<tool_call>" and lazy.prefix == "<tool_call>\n"
    req = constraint(hermes, TOOLS, "required", True)
    assert req is not None and req.prefix == "<tool_call>\n" and req.repeat
    assert constraint(generic, TOOLS, "none", True) is None


def test_tool_grammar_builds_and_bounds_apply():
    from llmd.backends.llamacpp.grammar import grammar_for_tools
    from llmd.chat.tools import ToolConstraint
    from llmd.errors import GrammarError

    c = constraint(detect(HERMES), TOOLS, "required", True)
    assert c is not None
    g = grammar_for_tools(c)
    assert g.startswith('root ::= "<tool_call>\\n" llmd-call "\\n</tool_call>" ("\\n" ')
    assert "{0,7}" in g.splitlines()[0]
    assert 'char ::= [^"\\\\\\x7F\\x00-\\x1F]' in g  # JSON strings hold no raw newline
    assert "char{0,50000}" in grammar_for_tools(ToolConstraint({"type": "string", "maxLength": 50000}))
    with pytest.raises(GrammarError, match="100000"):  # more than any context holds
        grammar_for_tools(ToolConstraint({"type": "string", "maxLength": 500_000}))


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("llama3", '<|python_tag|>get_weather.call(city="Oslo")'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
    ("gemma", "<start_function_call>call:get_weather{city:<escape>Oslo<escape>}<end_function_call>"),
    ("gemma", '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'),
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'),
    ("generic", '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'),
])
def test_parse_each_format(fmt: str, text: str):
    calls, _ = parse_calls(ChatFormat(fmt, False), text)  # type: ignore[arg-type]
    assert [(c.name, c.arguments_object) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_unparseable_call_stays_content():
    reply = ReplyParser(detect(HERMES), TOOLS).parse("<tool_call>\n{not json</tool_call>")
    assert reply.tool_calls == [] and reply.content == "<tool_call>\n{not json</tool_call>"


def test_stream_holds_only_what_may_be_a_call():
    p = ReplyParser(detect(HERMES), TOOLS)
    shown = "".join(p.feed(ch).content for ch in "Let me check. <tool_")
    assert shown == "Let me check. "  # "<tool_" may begin a call: held
    shown += "".join(p.feed(ch).content for ch in 'call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')
    end = p.finish()
    assert shown == "Let me check. " and [c.name for c in end.tool_calls] == ["add"]


def test_a_call_to_a_tool_not_offered_is_text():
    """Qwen2.5-Coder 1.5B answers "What is 2 + 2?" with a call to an `add` it was never given."""
    text = '{"name": "multiply", "arguments": {"a": 2, "b": 2}}'
    reply = ReplyParser(detect(HERMES), TOOLS).parse(text)
    assert reply.tool_calls == [] and reply.content == text
    reply = ReplyParser(detect(HERMES), TOOLS).parse('{"name": "add", "arguments": {"a": 2}}')
    assert [c.name for c in reply.tool_calls] == ["add"]


def test_generic_answer_streams_as_text():
    p = ReplyParser(detect(None), TOOLS)
    out = "".join(p.feed(ch).content for ch in '{"response": "Hi \\"you\\" \\u00e9\\n."}')
    assert out == 'Hi "you" é\n.' and p.finish().content == ""


def test_think_is_split_into_reasoning():
    reply = ReplyParser(detect(THINKING), None).parse("<think>Two plus two.</think>\n\nFour.")
    assert reply.reasoning == "Two plus two." and reply.content == "Four."
    plain = ReplyParser(detect(HERMES), None).parse("<think>kept</think>")  # a template without it
    assert plain.content == "<think>kept</think>"


def test_structured_calls_pass_through_the_parser_untouched():
    """A remote model's calls arrive parsed: content that looks like a call stays content, and the
    structured calls (ids kept) come out with the reply's end, streamed or whole."""
    from llmd.chat.formats import STRUCTURED

    p = ReplyParser(STRUCTURED, tools=TOOLS)
    first = p.feed('{"name": "x"} is JSON')
    assert first.content == '{"name": "x"} is JSON' and not first.tool_calls
    assert not p.feed("", (("call_up_1", "add", '{"a": 1}'),)).tool_calls  # held for the end
    end = p.finish()
    assert [(c.id, c.name, c.arguments) for c in end.tool_calls] == [("call_up_1", "add", '{"a": 1}')]
    whole = ReplyParser(STRUCTURED, tools=TOOLS).parse("<think>hm</think>Checking.", (("c1", "add", "{}"),))
    assert (whole.reasoning, whole.content, [c.id for c in whole.tool_calls]) == ("hm", "Checking.", ["c1"])


def test_hermes_calls_stream_as_they_are_decoded():
    text = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')
    p = ReplyParser(detect(HERMES), TOOLS, stream_calls=True)
    content, pieces = "", []
    for ch in text:
        d = p.feed(ch)
        content += d.content
        pieces += d.call_deltas
    end = p.finish()
    pieces += end.call_deltas
    assert content == "Checking. " and p.n_streamed == 2
    assert [(c.index, c.name) for c in pieces if c.name] == [(0, "get_weather"), (1, "add")]
    first = next(i for i, c in enumerate(pieces) if c.name == "get_weather")
    second = next(i for i, c in enumerate(pieces) if c.name == "add")
    assert first < second - 3  # the first call's arguments went out before the second call began
    args = ["".join(c.arguments for c in pieces if c.index == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [{"city": "Oslo"}, {"a": 2}]
    ids = {c.index: c.id for c in pieces if c.name}
    assert [(c.id, c.arguments) for c in end.tool_calls] == [(ids[0], args[0]), (ids[1], args[1])]


def test_a_bare_call_object_streams_too():
    p = ReplyParser(detect(HERMES), TOOLS, stream_calls=True)
    pieces = [c for ch in '{"name": "get_weather", "arguments": {"city": "Oslo"}}' for c in p.feed(ch).call_deltas]
    end = p.finish()
    assert pieces[0].name == "get_weather" and len(pieces) > 3
    assert end.tool_calls[0].arguments == "".join(c.arguments for c in pieces + end.call_deltas)


def test_a_call_in_a_json_code_fence_streams_too():
    """Qwen2.5-Coder's first call in Claude Code's 12,000-token prompt (recorded): a fenced object,
    streamed as decoded (held to the reply's end before: 6.4 s of nothing on a warm prompt)."""
    text = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo"\n  }\n}\n```'
    p = ReplyParser(detect(HERMES), TOOLS, stream_calls=True)
    pieces, content, announced = [], "", None
    for i, ch in enumerate(text):
        d = p.feed(ch)
        pieces += d.call_deltas
        content += d.content
        announced = i if announced is None and pieces else announced
    end = p.finish()
    assert pieces[0].name == "get_weather" and announced is not None and announced < text.index("Oslo")
    assert json.loads("".join(c.arguments for c in pieces + end.call_deltas)) == {"city": "Oslo"}
    assert content == "" and [c.id for c in end.tool_calls] == [pieces[0].id]
    q = ReplyParser(detect(HERMES), TOOLS, stream_calls=True)  # a fence of other code is text
    assert q.parse("```python\nprint(1)\n```").content == "```python\nprint(1)\n```" and q.n_streamed == 0


@pytest.mark.parametrize("text", [
    '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```\n\nThis looks up the weather.',
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\nThis looks up the weather.'])
def test_text_after_a_streamed_call_is_content_and_the_call_stays(text: str):
    """Recorded in a CI run of Claude Code: a fenced call, then an explanation. The call went out
    as it was decoded; at the end the reply was neither call nor text (both dropped)."""
    p = ReplyParser(detect(HERMES), TOOLS, stream_calls=True)
    pieces = [c for ch in text for c in p.feed(ch).call_deltas]
    end = p.finish()
    assert pieces[0].name == "get_weather" and [c.id for c in end.tool_calls] == [pieces[0].id]
    assert json.loads(end.tool_calls[0].arguments) == {"city": "Oslo"}
    assert end.content == "This looks up the weather."
    whole = ReplyParser(detect(HERMES), TOOLS).parse(text)  # the same without streaming
    assert [c.name for c in whole.tool_calls] == ["get_weather"] and whole.content == "This looks up the weather."


def test_a_call_that_strays_from_the_shape_is_parsed_whole():
    p = ReplyParser(detect(HERMES), TOOLS, stream_calls=True)
    d = p.feed('<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>')
    assert d.call_deltas == [] and d.content == ""
    end = p.finish()
    assert [c.name for c in end.tool_calls] == ["get_weather"] and p.n_streamed == 0


def test_the_lazy_grammar_waits_for_the_trigger_alone():
    """llama.cpp searches the whole reply so far with this pattern after every token: a pattern that
    spans the text (`[\\s\\S]*?(<tool_call>)[\\s\\S]*`) made each search quadratic in the reply's
    length (benchmarks/tool_reply.py: 0.42x the rate of the same reply without tools by its end)."""
    import re

    from llmd.backends.llamacpp.sampler import lazy_pattern

    for trigger in ("<tool_call>", "[TOOL_CALLS]"):
        pattern = lazy_pattern(trigger)
        assert pattern == f"({re.escape(trigger)})" and "*" not in pattern
        text = "Some prose first, then " + trigger + '\n{"name": "f"}'
        assert re.search(pattern, text).start(1) == text.index(trigger)  # where the grammar starts
        assert re.search(pattern, "prose only " * 500) is None
