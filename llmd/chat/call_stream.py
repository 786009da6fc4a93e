"""Tool calls while they are decoded: how far a Hermes-format reply has got in each call.

A Hermes call (Qwen, Hermes and the many templates that copy them) is
`<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`, the name first. Once the name
and the start of the arguments are in, the call can be announced and its arguments streamed as
they come, as OpenAI and vLLM stream them, instead of holding the whole reply to its end. A bare
call object without the tags (Qwen2.5-Coder writes its calls so more often than not) counts too,
and so does one in a ```json code fence (its way in Claude Code's long prompts); text after
such a call is content. A reply that strays from this shape is not streamed (None): it is parsed
whole at the end, as before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_NAME = re.compile(r'\{"name":"(?:[^"\\]|\\.)*')  # on text with whitespace removed
# a bare call in a Markdown code fence (Qwen2.5-Coder's way in long agent prompts): ```json\n{...}\n```
FENCE = re.compile(r"\s*```(?:json)?[ \t]*\n")


def _may_become_head(text: str) -> bool:
    """Whether `text` is the start of a call head still being written ('{"name": "get_w')."""
    squeezed = re.sub(r"\s+", "", text)
    if len(squeezed) <= len('{"name":"'):
        return '{"name":"'.startswith(squeezed)
    name = _NAME.match(squeezed)
    if name is None:
        return False
    rest = squeezed[name.end():]
    return '","arguments":'.startswith(rest)


@dataclass(frozen=True)
class CallProgress:
    name: str
    arguments: str  # the JSON text of the arguments so far
    complete: bool  # the arguments' JSON value is closed


def _json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at `start` ends (exclusive), or None if not yet."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def hermes_progress(text: str) -> list[CallProgress] | None:
    """The calls in `text` so far: <tool_call> blocks, or one bare call object (Qwen2.5 often
    writes its call without the tags); None when it is not in a shape that can be streamed (the
    caller then holds the reply and parses it whole)."""
    out: list[CallProgress] = []
    fence = FENCE.match(text)
    if fence is None and text.lstrip() and "```json".startswith(text.lstrip()):
        return out  # a fence's first line still being written
    bare = fence is not None or text.lstrip().startswith("{")
    pos = fence.end() if fence is not None else len(text) - len(text.lstrip()) if bare else 0
    while True:
        if not bare:
            rest = text[pos:].lstrip()
            if not rest:
                return out
            if not rest.startswith(_OPEN):
                return out if _OPEN.startswith(rest) else None
            pos = len(text) - len(rest) + len(_OPEN)
        head = _HEAD.match(text, pos)
        if head is None:
            return out if _may_become_head(text[pos:]) else None
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            return None
        start = head.end()
        if start >= len(text):
            return [*out, CallProgress(name, "", False)]
        if text[start] != "{":
            return None
        end = _json_value_end(text, start)
        if end is None:
            return [*out, CallProgress(name, text[start:], False)]
        out.append(CallProgress(name, text[start:end], True))
        tail = text[end:].lstrip()
        if not tail:
            return out
        if not tail.startswith("}"):
            return None
        after = tail[1:].lstrip()
        if fence is not None:  # one call object, the fence's end, and maybe text after it (content)
            return out if "```".startswith(after) or after.startswith("```") else None
        if bare:  # one call object; text after it is content (parse_calls gives it so at the end)
            return out
        if not after.startswith(_CLOSE):
            return out if _CLOSE.startswith(after) else None
        pos = len(text) - len(after) + len(_CLOSE)
