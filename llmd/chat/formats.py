"""What a chat template says about a model's output: how it writes tool calls, and whether it thinks.

A pure function of the template's source, so the engine (which renders prompts and constrains
decoding) and the daemon (which parses replies, also when replaying them from the cache) always
agree on the format without asking each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# "structured": the calls arrive parsed (a remote upstream parses its model's output itself)
ToolFormat = Literal["hermes", "llama3", "mistral", "gemma", "generic", "structured"]

@dataclass(frozen=True)
class ChatFormat:
    tools: ToolFormat
    thinking: bool  # the template writes <think>...</think> reasoning

    @property
    def native_tools(self) -> bool:
        return self.tools != "generic"


def detect(template: str | None) -> ChatFormat:
    """The format a template uses. Tool support is recognised by the markers the template
    writes (never by the model's name); a template that never reads `tools` gets the generic one."""
    src = template or ""
    thinking = "<think>" in src
    uses_tools = "tools" in src or "tool_calls" in src
    fmt: ToolFormat = "generic"
    if uses_tools:
        if "<tool_call>" in src:
            fmt = "hermes"
        elif "[TOOL_CALLS]" in src:
            fmt = "mistral"
        elif "<start_function_call>" in src or "<|tool_call>call:" in src:  # FunctionGemma, Gemma 4
            fmt = "gemma"
        elif "<|start_header_id|>" in src and ("<|python_tag|>" in src or '"parameters"' in src
                                              or "parameters" in src):
            fmt = "llama3"
    return ChatFormat(tools=fmt, thinking=thinking)


# A remote model: its upstream renders the template and parses calls; reasoning is relayed as a
# <think> block, so the same parser splits it out for every API.
STRUCTURED = ChatFormat(tools="structured", thinking=True)
