"""Chat templates from the model file, rendered in a sandboxed jinja2 environment.

The template comes from the model file, which may come from anywhere: the sandbox keeps it
from reaching Python internals. Models without a template get ChatML, and say so.
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
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
    if indent is not None and not (isinstance(indent, int) and 0 <= indent <= 16):
        raise TemplateError(f"tojson(indent={indent!r}): at most 16")
    out = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if len(out) > MAX_RENDER_CHARS:
        raise TemplateError(f"tojson wrote more than {MAX_RENDER_CHARS} characters")
    return out


def _raise(message: str) -> None:
    raise TemplateError(message)


# A template is code from a downloaded file: beside the sandbox, its work is bounded. Loops over
# `range` share one budget per render (the sandbox bounds each range, not nested ones); the whole
# render has a deadline that interrupts any Python-level work (a loop that writes nothing
# included); nothing the template computes in one C-level step may grow past MAX_RENDER_CHARS
# ('x' * 10**10, ljust(10**10), tojson(indent=...)); the output is cut off (a 400) past it.
MAX_RANGE_STEPS = 1_000_000
MAX_RENDER_CHARS = 64 * 1024 * 1024
MAX_RENDER_S = 5.0


class RenderTimeout(Exception):
    """Raised inside the rendering thread when its deadline passes."""


class _Deadline:
    """Interrupts the thread that made it after `seconds` (an exception raised at its next Python
    step), unless closed first; a pending interruption never escapes `close`'s caller's render."""

    def __init__(self, seconds: float) -> None:
        self._tid = threading.get_ident()
        self._lock = threading.Lock()
        self._live = True
        self._fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._live:
                self._fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), ctypes.py_object(RenderTimeout))

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._live = False
            if self._fired:  # delivered already, or about to be: cleared either way
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple) else 0


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with the operators and calls that can build a huge value in one step bounded."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            n, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(n, int) and _size(seq) * max(n, 0) > MAX_RENDER_CHARS:
                raise TemplateError(f"the chat template multiplies a sequence past {MAX_RENDER_CHARS} items")
        if operator == "**" and isinstance(right, int | float) and abs(right) > 256:
            raise TemplateError("the chat template raises a number to a power over 256")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's)
        if any(isinstance(a, int) and not isinstance(a, bool) and a > MAX_RENDER_CHARS
               for a in (*args, *kwargs.values())):
            raise TemplateError(f"the chat template calls {__obj!r} with a number over {MAX_RENDER_CHARS}")
        return super().call(__context, __obj, *args, **kwargs)


def _bounded_filter(name: str, fn: Any) -> Any:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, int) and not isinstance(a, bool) and a > MAX_RENDER_CHARS
               for a in (*args, *kwargs.values())):
            raise TemplateError(f"the chat template's {name} filter was given a number over {MAX_RENDER_CHARS}")
        return fn(*args, **kwargs)
    return bounded


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
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        for name in ("center", "indent", "wordwrap", "truncate", "format", "batch", "slice"):
            if name in env.filters:
                env.filters[name] = _bounded_filter(name, env.filters[name])
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
            deadline = _Deadline(MAX_RENDER_S)
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
                    if size > MAX_RENDER_CHARS:
                        raise TemplateError(f"the chat template's output ran past {MAX_RENDER_CHARS} characters; "
                                            "is it a real chat template?")
                    out.append(piece)
            finally:
                deadline.close()
            return "".join(out)
        except RenderTimeout:
            raise BadRequest(f"the model's chat template ran past {MAX_RENDER_S:g} s on these messages; is it a "
                             "real chat template?", "messages") from None
        except (TemplateError, MemoryError, RecursionError, OverflowError) as e:
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
        cannot forge a turn. Each content is swapped for a sentinel while rendering, so the
        template's own text is known exactly; a template that changes contents (trims them, say)
        gets them as they were sent, never parsed for special tokens."""
        contents = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
        marked = [{**m, "content": f"\ue000{i}\ue001"} if c else m for i, (m, c) in enumerate(zip(messages, contents,
                                                                                              strict=True))]
        skeleton = _SENTINEL.split(self.render(marked, tools=tools))  # template text, index, template text...
        pieces: list[tuple[str, bool]] = []
        for k, part in enumerate(skeleton):
            if k % 2 == 0:
                # Qwen2.5's doubled braces, fixed in the template's own text only (never in a message)
                pieces.append((part.replace(*_QWEN_CALL_EXAMPLE) if tools else part, False))
            elif 0 <= int(part) < len(contents) and contents[int(part)]:
                pieces.append((str(contents[int(part)]), True))
        return [p for p in pieces if p[0]]

    def tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               tokenize: Callable[[str, bool, bool], list[int]], add_bos: bool) -> list[int]:
        """The rendered prompt as tokens (tokenize: text, add_special, parse_special): the template's
        own text parsed for special tokens, message contents never (no forged turns, and linear
        time); the BOS token added unless the template writes it itself."""
        pieces = self.render_pieces(messages, tools)
        text = "".join(p for p, _ in pieces)
        add_special = add_bos and not (self._bos and text.startswith(self._bos))
        prompt: list[int] = []
        for i, (piece, is_content) in enumerate(pieces):
            prompt += tokenize(piece, add_special and i == 0, not is_content)
        return prompt


_SENTINEL = re.compile("\ue000(\\d+)\ue001")
