"""Chat templates from GGUF metadata, rendered in a sandboxed jinja2 environment.

The template comes from the model file, which may come from anywhere: the sandbox keeps it
from reaching Python internals. Models without a template get ChatML, and say so.
"""

from __future__ import annotations

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


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        self.builtin = source is None
        self.source = source if source is not None else CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(self.source)
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except TemplateError as e:
            raise BadRequest(f"the model's chat template refused these messages: {e}", "messages") from None
