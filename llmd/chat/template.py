"""Chat templates from the model file, rendered in a sandboxed jinja2 environment.

The template comes from the model file, which may come from anywhere: the sandbox keeps it
from reaching Python internals. Models without a template get ChatML, and say so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmd.errors import BadRequest

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Qwen2.5's template shows the call format with doubled braces (a Python str.format escape that
# Jinja keeps), and its small models then write calls as `{{"name": ...}}` text instead of
# <tool_call> blocks, also after a tool result. Ollama's own Qwen templates show single braces;
# so does llmd.
_QWEN_CALL_EXAMPLE = ('<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>',
                      '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


# A template is code from a downloaded file: beside the sandbox, its work is bounded. Loops over
# `range` share one budget per render (the sandbox bounds each range, not nested ones), and the
# output is cut off (a 400) past MAX_RENDER_CHARS; messages themselves are bounded by the body limit.
MAX_RANGE_STEPS = 1_000_000
MAX_RENDER_CHARS = 64 * 1024 * 1024
MAX_RENDER_S = 5.0


class _Budget:
    """The range steps and time one render may spend."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_RENDER_S

    def range(self, *args: int) -> Iterator[int]:
        r = range(*args)
        if len(r) > MAX_RANGE_STEPS:
            raise TemplateError(f"the chat template asked for a range of {len(r)} steps (at most {MAX_RANGE_STEPS})")
        for i in r:
            self.steps += 1
            if self.steps > MAX_RANGE_STEPS or (self.steps % 4096 == 0 and time.monotonic() > self.deadline):
                raise TemplateError(f"the chat template ran past its bound ({MAX_RANGE_STEPS} loop steps or "
                                    f"{MAX_RENDER_S:g} s); is it a real chat template?")
            yield i


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        self.builtin = source is None
        self.source = source if source is not None else CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        # tojson as transformers defines it for chat templates: keys in the order given, no HTML
        # escaping (Jinja's own sorts keys and writes < as \u003c: tool definitions then read
        # differently from what the model was trained on)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(self.source)
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt, with `tools` given to the template as transformers' apply_chat_template does
        (a list of OpenAI-shaped {"type": "function", "function": {...}} objects, or unset)."""
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        budget = _Budget()
        try:
            out: list[str] = []
            size = 0
            for piece in self._template.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                range=budget.range,
                **extra,
            ):
                size += len(piece)
                if size > MAX_RENDER_CHARS or time.monotonic() > budget.deadline:
                    raise TemplateError(f"the chat template's output ran past {MAX_RENDER_CHARS} characters or "
                                        f"{MAX_RENDER_S:g} s; is it a real chat template?")
                out.append(piece)
            text = "".join(out)
            return text.replace(*_QWEN_CALL_EXAMPLE) if tools else text
        except TemplateError as e:
            raise BadRequest(f"the model's chat template refused these messages: {e}", "messages") from None

    def between_turns(self) -> str:
        """What the template puts between the end of an assistant reply and the next user message
        ("<|im_end|>\n<|im_start|>user\n" for ChatML); "" when it cannot be told."""
        a, b = "\ue000reply\ue001", "\ue000next\ue001"
        try:
            text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": a},
                                {"role": "user", "content": b}], add_generation_prompt=False)
        except Exception:
            return ""
        i, j = text.find(a), text.find(b)
        return text[i + len(a):j] if 0 <= i and i + len(a) < j else ""

    def render_pieces(self, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None = None) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, is_message_content) pieces, so the engine can tokenize what
        users wrote without special-token parsing: a message saying "<|im_end|>" stays text and
        cannot forge a turn. Each content is swapped for a sentinel while rendering; a template
        that changes contents beyond recognition gets its contents found in order instead."""
        contents = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
        marked = [{**m, "content": f"\ue000{i}\ue001"} if c else m for i, (m, c) in enumerate(zip(messages, contents,
                                                                                              strict=True))]
        text = self.render(marked, tools=tools)
        pieces: list[tuple[str, bool]] = []
        cursor = 0
        for i, c in enumerate(contents):
            if not c:
                continue
            mark = f"\ue000{i}\ue001"
            at = text.find(mark, cursor)
            if at < 0 or text.count(mark) != 1:
                return _find_in_order(self.render(messages, tools=tools), [c for c in contents if c])
            pieces.append((text[cursor:at], False))
            pieces.append((c, True))
            cursor = at + len(mark)
        pieces.append((text[cursor:], False))
        plain = self.render(messages, tools=tools)
        if "".join(p for p, _ in pieces) != plain:  # the template transforms contents (upper, trim...)
            return _find_in_order(plain, [c for c in contents if c])
        return [p for p in pieces if p[0]]


def _find_in_order(text: str, contents: list[str]) -> list[tuple[str, bool]]:
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for c in contents:
        at = text.find(c, cursor)
        if at < 0:
            continue
        pieces.append((text[cursor:at], False))
        pieces.append((c, True))
        cursor = at + len(c)
    pieces.append((text[cursor:], False))
    return [p for p in pieces if p[0]]
