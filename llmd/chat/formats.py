"""What a chat template says about a model's output: how it writes tool calls, and whether it thinks.

A pure function of the template's source, so the engine (which renders prompts and constrains
decoding) and the daemon (which parses replies, also when replaying them from the cache) always
agree on the format without asking each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ToolFormat = Literal["hermes", "llama3", "mistral", "gemma", "generic"]

# what each native format looks like, for README and /api/show
FORMAT_HELP: dict[str, str] = {
    "hermes": "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (Hermes, Qwen 2.5/3)",
    "llama3": "{\"name\": ..., \"parameters\": ...} or <|python_tag|> (Llama 3.1-3.3)",
    "mistral": "[TOOL_CALLS][{\"name\": ..., \"arguments\": ...}] (Mistral, Mixtral, Nemo)",
    "gemma": "<start_function_call>call:NAME{...}<end_function_call> (FunctionGemma), "
             "<|tool_call>call:NAME{...}<tool_call|> (Gemma 4)",
    "generic": "{\"tool_calls\": [...]} or {\"response\": ...}, described in a system message and held "
               "to a grammar (templates without tool support)",
}


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
