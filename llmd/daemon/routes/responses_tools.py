"""The Responses API's tool types, as the model sees them and as the client gets them back.

Function tools go to the model as they are. A `namespace` tool groups function and custom tools:
each is offered as `NAMESPACE.NAME`, and its calls come back as items naming the tool and its
`namespace`, as OpenAI answers. A `custom` (freeform) tool is offered as a function of one string,
`input`, and its calls come back as `custom_tool_call` items. Hosted tools a local daemon cannot run
(web_search, file_search, code_interpreter, computer use, image generation, MCP servers, ...) are
left out of what the model sees and named in X-LLMD-Ignored, as Ollama passes them by without an
error (Codex CLI sends web_search with every request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llmd.daemon.routes._common import normalize_tools
from llmd.errors import BadRequest

CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


@dataclass(frozen=True)
class Origin:
    """What a model-facing tool name stands for."""

    kind: str  # "function" | "custom"
    name: str
    namespace: str | None = None


@dataclass
class ToolMap:
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-shaped, for the model
    origins: dict[str, Origin] = field(default_factory=dict)  # model-facing name -> the client's tool
    ignored: list[str] = field(default_factory=list)  # "tools[3] (web_search)"

    def model_name(self, name: str, namespace: str | None = None) -> str:
        return f"{namespace}.{name}" if namespace else name

    def output_item(self, call_id: str, item_id: str, name: str, arguments: str) -> dict[str, Any]:
        """The output item for a call the model made, in the shape the client's tool expects."""
        o = self.origins.get(name, Origin("function", name))
        if o.kind == "custom":
            try:
                text = json.loads(arguments).get("input", "")
            except (ValueError, AttributeError):
                text = arguments
            return {"type": "custom_tool_call", "id": "ctc_" + item_id, "call_id": call_id, "name": o.name,
                    "input": text if isinstance(text, str) else json.dumps(text), "status": "completed"}
        item = {"type": "function_call", "id": "fc_" + item_id, "call_id": call_id, "name": o.name,
                "arguments": arguments, "status": "completed"}
        return {**item, "namespace": o.namespace} if o.namespace else item


def _function(t: dict[str, Any], name: str) -> dict[str, Any]:
    fields = {k: v for k, v in t.items() if k not in ("type", "function", "strict", "defer_loading")}
    fn = t.get("function")
    inner: dict[str, Any] = fn if isinstance(fn, dict) else fields
    return {"type": "function", "function": {**inner, "name": name}}


def _custom(t: dict[str, Any], name: str) -> dict[str, Any]:
    desc = t.get("description") or ""
    given = t.get("format")
    fmt: dict[str, Any] = given if isinstance(given, dict) else {}
    if fmt.get("type") == "grammar" and fmt.get("definition"):  # described; llama.cpp cannot hold Lark/regex
        desc += f"\nThe input must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return {"type": "function", "function": {"name": name, "description": desc.strip(), "parameters": CUSTOM_INPUT}}


def map_tools(tools: list[Any] | None) -> ToolMap:
    m = ToolMap()
    raw: list[dict[str, Any]] = []
    for i, t in enumerate(tools or []):
        kind = t.get("type", "function") if isinstance(t, dict) else None
        if kind == "function":
            raw.append(_function(t, str(t.get("name") or (t.get("function") or {}).get("name") or "")))
        elif kind == "custom":
            raw.append(_custom(t, str(t.get("name", ""))))
            m.origins[raw[-1]["function"]["name"]] = Origin("custom", str(t.get("name", "")))
        elif kind == "namespace":
            ns = str(t.get("name", ""))
            for j, inner in enumerate(t.get("tools") or []):
                if not isinstance(inner, dict) or inner.get("type", "function") not in ("function", "custom"):
                    raise BadRequest(f"tools[{i}].tools[{j}] must be a function or custom tool", f"tools[{i}]")
                name = str(inner.get("name", ""))
                full = m.model_name(name, ns)
                custom = inner.get("type") == "custom"
                raw.append(_custom(inner, full) if custom else _function(inner, full))
                m.origins[full] = Origin("custom" if custom else "function", name, ns)
        elif isinstance(kind, str):
            m.ignored.append(f"tools[{i}] ({kind[:40]})")
        else:
            raise BadRequest(f"tools[{i}] is not a tool object", f"tools[{i}]")
    m.tools = normalize_tools(raw) or []
    return m
