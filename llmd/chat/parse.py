"""Replies on the way out: a model's text split into content, reasoning and tool calls.

`ReplyParser` takes the text as it streams and hands back deltas as soon as they are certain:
plain content flows through; text that may start a tool call (or a think block) is held until it
is known; at the end whatever was held and did not parse as a call is released as content, so
nothing the model wrote is ever dropped. The same parser runs on a reply replayed from the cache.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmd.chat.call_stream import FENCE, hermes_progress
from llmd.chat.formats import ChatFormat

_MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "gemma": ("<start_function_call>", "<|tool_call>"),
            "llama3": ("<|python_tag|>",), "generic": (), "structured": ()}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def arguments_object(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class CallDelta:
    """A piece of a call being decoded: its name with the first piece, then argument text."""

    index: int
    id: str
    name: str | None
    arguments: str


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # whole calls, at the end
    call_deltas: list[CallDelta] = field(default_factory=list)  # calls streamed as decoded (stream_calls)


@dataclass
class Reply:
    content: str
    reasoning: str
    tool_calls: list[ToolCall]


def _call(name: Any, args: Any) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _calls_from_json(obj: Any) -> list[ToolCall] | None:
    """Calls in any of the JSON shapes models write: {"tool_calls": [...]}, {"name", "arguments"},
    {"name", "parameters"}, {"function": {...}}, or a list of those."""
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        obj = obj["tool_calls"]
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        fn: dict[str, Any] = item["function"] if isinstance(item.get("function"), dict) else item
        c = _call(fn.get("name"), fn.get("arguments", fn.get("parameters")))
        if c is None:
            return None
        calls.append(c)
    return calls or None


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` and where it ends."""
    try:
        return json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None


def _strip_fence(text: str) -> str:
    m = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*```\s*", text, re.S)
    return m.group(1) if m else text.strip()


_ESCAPES_GEMMA = ("<escape>", '<|"|>')  # FunctionGemma's string quote, Gemma 4's


def _gemma_value(s: str, i: int) -> tuple[Any, int]:
    """One value of Gemma's argument syntax: <escape>text<escape> (Gemma 4: <|"|>text<|"|>),
    {k:v,...}, [v,...], or a bare number / true / false / null."""
    for quote in _ESCAPES_GEMMA:
        if s.startswith(quote, i):
            end = s.index(quote, i + len(quote))
            return s[i + len(quote):end], end + len(quote)
    if s[i] == "{":
        out: dict[str, Any] = {}
        i += 1
        while s[i] != "}":
            colon = s.index(":", i)
            key = s[i:colon].strip()
            out[key], i = _gemma_value(s, colon + 1)
            if s[i] == ",":
                i += 1
        return out, i + 1
    if s[i] == "[":
        items = []
        i += 1
        while s[i] != "]":
            v, i = _gemma_value(s, i)
            items.append(v)
            if s[i] == ",":
                i += 1
        return items, i + 1
    m = re.compile(r"[^,}\]]*").match(s, i)
    assert m is not None
    word = m.group(0).strip()
    try:
        return json.loads(word), m.end()
    except ValueError:
        return word, m.end()


def _gemma_calls(text: str) -> tuple[list[ToolCall], str] | None:
    calls, rest = [], []
    cursor = 0
    for m in re.finditer(r"(?:<start_function_call>|<\|tool_call>)call:([\w.\-]+)(\{.*?\})"
                         r"(?:<end_function_call>|<tool_call\|>)", text, re.S):
        try:
            args, _ = _gemma_value(m.group(2), 0)
        except (ValueError, IndexError):
            return None
        c = _call(m.group(1), args)
        if c is None:
            return None
        calls.append(c)
        rest.append(text[cursor:m.start()])
        cursor = m.end()
    rest.append(text[cursor:])
    return (calls, "".join(rest).strip()) if calls else None


def _python_tag_call(text: str) -> list[ToolCall] | None:
    """Llama 3.x built-in tools: `name.call(key="value", ...)` (or JSON) after <|python_tag|>."""
    parsed = _json_prefix(text.strip())
    if parsed is not None:
        return _calls_from_json(parsed[0])
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call"
            and isinstance(node.func.value, ast.Name)):
        return None
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except ValueError:
        return None
    c = _call(node.func.value.id, args)
    return [c] if c else None


def _leading_call(text: str) -> tuple[list[ToolCall], str] | None:
    """A call object that starts the reply, bare or in a ```json fence, with text after it: the
    call, and that text as content. Qwen2.5-Coder often explains a fenced call after it; the call
    was streamed as decoded (call_stream), so it must not turn back into text at the end."""
    fence = FENCE.match(text)
    start = fence.end() if fence else len(text) - len(text.lstrip())
    parsed = _json_prefix(text[start:]) if text[start:start + 1] == "{" else None
    calls = _calls_from_json(parsed[0]) if parsed else None
    if not calls or parsed is None:
        return None
    rest = text[start + parsed[1]:].lstrip()
    if fence:
        if not rest.startswith("```"):
            return None
        rest = rest[3:]
    return calls, rest.strip()


def parse_calls(fmt: ChatFormat, text: str) -> tuple[list[ToolCall], str]:
    """The calls in a whole reply and the content left around them; ([], text) when none parse."""
    body = _strip_fence(text)
    whole = _json_prefix(body)
    if whole is not None and not body[whole[1]:].strip():
        obj = whole[0]
        if isinstance(obj, dict) and set(obj) == {"response"} and isinstance(obj["response"], str):
            return [], obj["response"]
        whole_calls = _calls_from_json(obj)
        if whole_calls:
            return whole_calls, ""
    if fmt.tools == "hermes" and "<tool_call>" not in text and (lead := _leading_call(text)) is not None:
        return lead
    if fmt.tools == "hermes" and "<tool_call>" in text:
        calls: list[ToolCall] = []
        rest: list[str] = []
        cursor = 0
        for block in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
            parsed = _json_prefix(block.group(1))
            found = _calls_from_json(parsed[0]) if parsed else None
            if not found:
                return [], text
            calls += found
            rest.append(text[cursor:block.start()])
            cursor = block.end()
        rest.append(text[cursor:])
        return calls, "".join(rest).strip()
    if fmt.tools == "mistral" and "[TOOL_CALLS]" in text:
        head, _, tail = text.partition("[TOOL_CALLS]")
        tail = tail.strip()
        parsed = _json_prefix(tail)
        if parsed is not None:
            found = _calls_from_json(parsed[0])
            if found:
                return found, (head + tail[parsed[1]:]).strip()
        named = re.match(r"([\w.\-]+)\[ARGS\](.*)", tail, re.S)  # newer form: NAME[ARGS]{...}
        args_text = named.group(2).strip() if named else ""
        parsed = _json_prefix(args_text) if named else None
        if named and parsed:
            c = _call(named.group(1), parsed[0])
            if c:
                return [c], (head + args_text[parsed[1]:]).strip()
        return [], text
    if fmt.tools == "gemma" and ("<start_function_call>" in text or "<|tool_call>" in text):
        found_g = _gemma_calls(text)
        return found_g if found_g else ([], text)
    if fmt.tools == "llama3" and "<|python_tag|>" in text:
        head, _, tail = text.partition("<|python_tag|>")
        found = _python_tag_call(tail.replace("<|eom_id|>", ""))
        return (found, head.strip()) if found else ([], text)
    return [], text


class ReplyParser:
    """Streams deltas for one reply. `tools`: the tools the request offered, OpenAI-shaped (none:
    no call parsing). A "call" to a tool not offered is the model's text, not a call: an app
    cannot run it, and OpenAI never answers with one."""

    def __init__(self, fmt: ChatFormat, tools: list[dict[str, Any]] | None, think: bool = True,
                 stream_calls: bool = False) -> None:
        """`stream_calls`: hand out Hermes-format calls as they are decoded (call_deltas), for
        routes that stream calls in pieces; the whole calls still come at the end, those already
        streamed first and under the same ids (`n_streamed` of them)."""
        self.fmt = fmt
        self.tools = bool(tools)
        self.names = frozenset(t["function"]["name"] for t in tools or ())
        self.stream_calls = stream_calls and self.tools and fmt.tools == "hermes"
        self.sent: list[tuple[str, str, str]] = []  # streamed calls: (id, name, arguments sent)
        self.think = think and fmt.thinking
        self.buf = ""
        self.held = False  # a tool call may have started: keep everything until the end
        self.in_think = False
        self.started = False  # something other than whitespace was seen
        self.generic_answer: int | None = None  # generic format: where the "response" string starts
        self.structured: list[ToolCall] = []  # calls that arrived parsed: handed out at the end
        self.reply = Reply("", "", [])

    def _markers(self) -> tuple[str, ...]:
        return _MARKERS[self.fmt.tools] if self.tools else ()

    def feed(self, text: str, calls: tuple[tuple[str, str, str], ...] = ()) -> Delta:
        """`calls`: structured (id, name, arguments) calls from an engine that parsed them itself."""
        self.structured += [ToolCall(name, args, call_id) for call_id, name, args in calls]
        self.buf += text
        out = Delta()
        while True:
            if self.in_think:
                end = self.buf.find("</think>")
                if end < 0:
                    keep = _partial_suffix(self.buf, ("</think>",))
                    out.reasoning += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                out.reasoning += self.buf[:end]
                self.buf = self.buf[end + len("</think>"):].lstrip()
                self.in_think = False
                continue
            if self.held:
                if self.tools and self.fmt.tools == "generic":
                    out.content += self._generic_stream()
                break
            if not self.started:
                stripped = self.buf.lstrip()
                if not stripped:
                    break
                if self.think and (stripped.startswith("<think>") or "<think>".startswith(stripped)):
                    if len(stripped) < len("<think>"):
                        break
                    self.buf = stripped[len("<think>"):]
                    self.in_think = True
                    continue
                self.started = True
                if self.tools and self.fmt.tools != "structured" and (stripped[0] in "{[`"
                                                                      or self.fmt.tools == "generic"):
                    self.buf, self.held = stripped, True  # a JSON call (or the generic shape) may follow
                    continue
            markers = self._markers()
            at = min((i for i in (self.buf.find(m) for m in markers) if i >= 0), default=-1)
            if at >= 0:
                out.content += self.buf[:at]
                self.buf = self.buf[at:]
                self.held = True
                break
            keep = _partial_suffix(self.buf, markers)
            out.content += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            break
        if self.held and self.stream_calls:
            out.call_deltas = self._call_deltas(self.buf)
        self._record(out)
        return out

    @property
    def n_streamed(self) -> int:
        return len(self.sent)

    def _call_deltas(self, text: str) -> list[CallDelta]:
        """What is new in the calls of the held text since the last time."""
        progress = hermes_progress(text)
        out: list[CallDelta] = []
        for i, p in enumerate(progress or ()):
            if p.name not in self.names:  # not a call an app can run: parsed whole at the end
                self.stream_calls = False
                break
            if i == len(self.sent):
                self.sent.append(("call_" + uuid.uuid4().hex[:24], p.name, ""))
                out.append(CallDelta(i, self.sent[i][0], p.name, p.arguments))
            elif len(p.arguments) > len(self.sent[i][2]):
                out.append(CallDelta(i, self.sent[i][0], None, p.arguments[len(self.sent[i][2]):]))
            else:
                continue
            self.sent[i] = (self.sent[i][0], p.name, p.arguments)
        return out

    def _generic_stream(self) -> str:
        """Generic format: once the reply is known to be {"response": "...", stream that string."""
        if self.generic_answer is None:
            m = _GENERIC_ANSWER.match(self.buf)
            if m is None:
                return ""
            self.generic_answer = m.end()
        text, self.generic_answer = _partial_json_string(self.buf, self.generic_answer)
        return text

    def finish(self) -> Delta:
        out = Delta()
        rest, self.buf = self.buf, ""
        if self.in_think:
            out.reasoning += rest
        elif self.held:
            calls, content = parse_calls(self.fmt, rest)
            if any(c.name not in self.names for c in calls):
                calls, content = [], rest
            if self.sent:
                # the rest of what was streamed; the whole calls keep the ids and text sent
                out.call_deltas = self._call_deltas(rest) if self.stream_calls else []
                for i, (cid, name, args) in enumerate(self.sent[:len(calls)]):
                    calls[i] = ToolCall(name, args if _same_json(args, calls[i].arguments) else calls[i].arguments,
                                        cid)
                if not calls:  # cut short inside a call: its pieces went out as the call, not as text
                    content = ""
            out.tool_calls = calls
            out.content = content if self.generic_answer is None else ""
        else:
            out.content += rest
        out.tool_calls += self.structured
        self.structured = []
        self._record(out)
        return out

    def _record(self, d: Delta) -> None:
        self.reply.content += d.content
        self.reply.reasoning += d.reasoning
        self.reply.tool_calls += d.tool_calls

    def parse(self, text: str, calls: tuple[tuple[str, str, str], ...] = ()) -> Reply:
        """The whole reply at once (non-streamed answers)."""
        self.feed(text, calls)
        self.finish()
        self.reply.content = self.reply.content.strip() if self.reply.tool_calls else self.reply.content
        return self.reply


def _same_json(a: str, b: str) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def reply_parser(fmt: ChatFormat, tools: list[dict[str, Any]] | None, stream_calls: bool = False) -> ReplyParser | None:
    """A parser when the reply may hold tool calls or reasoning; None when its text is the content
    as it is (no per-token work for a plain chat)."""
    return ReplyParser(fmt, tools, stream_calls=stream_calls) if tools or fmt.thinking else None


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


_GENERIC_ANSWER = re.compile(r'\{\s*"response"\s*:\s*"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _partial_json_string(text: str, start: int) -> tuple[str, int]:
    """A JSON string's characters from `start` as far as they are complete, and where to go on;
    stops at the closing quote (and stays there)."""
    out: list[str] = []
    i = start
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return "".join(out), i  # the end of the string: nothing more to stream
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(text):
            break
        esc = text[i + 1]
        if esc == "u":
            if i + 6 > len(text):
                break
            code = int(text[i + 2:i + 6], 16)
            if 0xD800 <= code < 0xDC00:  # a surrogate pair: wait for the second half
                if i + 12 > len(text):
                    break
                low = int(text[i + 8:i + 12], 16)
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
                continue
            out.append(chr(code))
            i += 6
            continue
        out.append(_ESCAPES.get(esc, esc))
        i += 2
    return "".join(out), i
