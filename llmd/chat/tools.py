"""Tools on the way in: the messages and the decoding constraint for a request that offers tools.

Backend-neutral. A template with native tool support gets the tools and the history as
transformers' apply_chat_template gives them (`tools=[...]`, assistant `tool_calls` with
arguments as objects, `tool` role messages). A template without it gets the generic format: the
tools described in a system message and the reply held to a JSON shape that is either a call or
an answer, as llama.cpp's server does for such templates.

`tool_choice` "required" or a named tool (and the generic format always) constrain decoding to a
JSON schema built from the tools' own schemas, so the call parses and its arguments validate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from llmd.chat.formats import ChatFormat
from llmd.chat.schema import loosen
from llmd.errors import BadRequest

# The most calls one reply may make when parallel calls are allowed: a small model held to a call
# grammar otherwise repeats calls until max_tokens and no call arrives whole.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolConstraint:
    """Decoding held to `prefix` + JSON matching `schema` + `suffix` (repeated when `repeat`)."""

    schema: dict[str, Any]
    prefix: str = ""
    suffix: str = ""
    repeat: bool = False
    # lazy (tool_choice auto): the model writes freely until it writes `trigger`, the start of a
    # call; from there the call is held to the offered tools and their schemas, as llama-server does
    trigger: str = ""
    # the same shape with every tool's arguments any JSON object: for a schema the grammar
    # converter cannot take, the call's name and shape are still held (never a refused request)
    fallback: dict[str, Any] | None = None


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check_choice(tools: list[dict[str, Any]] | None, tool_choice: str) -> None:
    """A named tool_choice must name an offered tool; "required" needs tools."""
    if tool_choice in ("auto", "none"):
        return
    if not tools:
        raise BadRequest(f"tool_choice is {tool_choice!r} but the request offers no tools", "tool_choice")
    if tool_choice != "required" and tool_choice not in tool_names(tools):
        raise BadRequest(f"tool_choice names {tool_choice!r}, which is not among the tools offered "
                         f"({', '.join(tool_names(tools))})", "tool_choice")


def _arguments_object(arguments: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates expect the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
    return arguments


def _mistral_id(call_id: str) -> str:
    # Mistral's templates insist on 9 alphanumeric characters; map any id onto that, stably
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def native_messages(fmt: ChatFormat, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as chat templates with tool support read it."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function", c)
                call_id = str(c.get("id") or "")
                if fmt.tools == "mistral":
                    call_id = _mistral_id(call_id or str(fn.get("name", "")))
                call = {"type": "function", "id": call_id,
                        "function": {"name": fn.get("name", ""), "arguments": _arguments_object(fn.get("arguments"))}}
                calls.append(call)
            m["tool_calls"] = calls
            if m.get("content") is None:
                m["content"] = ""
        if m.get("role") == "tool" and fmt.tools == "mistral" and m.get("tool_call_id"):
            m["tool_call_id"] = _mistral_id(m["tool_call_id"])
        out.append(m)
    return out


def _describe(tools: list[dict[str, Any]], tool_choice: str) -> str:
    lines = [json.dumps({"name": t["function"]["name"], "description": t["function"].get("description", ""),
                         "parameters": t["function"].get("parameters") or {"type": "object"}},
                        ensure_ascii=False) for t in tools]
    if tool_choice == "required":
        rule = 'You must call one or more of these tools. Reply with one JSON object: {"tool_calls": [{"name": ' \
               '"<tool name>", "arguments": {<arguments>}}]}.'
    elif tool_choice not in ("auto", "none"):
        rule = f'You must call the tool "{tool_choice}". Reply with one JSON object: {{"tool_calls": [{{"name": ' \
               f'"{tool_choice}", "arguments": {{<arguments>}}}}]}}.'
    else:
        rule = 'To call tools, reply with one JSON object: {"tool_calls": [{"name": "<tool name>", "arguments": ' \
               '{<arguments>}}]}. To answer without a tool, reply with {"response": "<your answer>"}.'
    return "You can use these tools, each given as JSON:\n" + "\n".join(lines) + "\n\n" + rule


def generic_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                     tool_choice: str) -> list[dict[str, Any]]:
    """The history for a template that knows only roles and text: the tools in the system message,
    earlier replies in the JSON shape the model is asked to use, tool results as user turns."""
    out: list[dict[str, Any]] = []
    described = _describe(tools, tool_choice) if tools else ""

    def add(role: str, content: str) -> None:
        if out and out[-1]["role"] == role and role == "user":  # templates that insist on alternation
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append({"role": role, "content": content})

    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role in ("system", "developer"):
            add("system", content)
        elif role == "assistant":
            if m.get("tool_calls"):
                calls = [{"name": c.get("function", c).get("name", ""),
                          "arguments": _arguments_object(c.get("function", c).get("arguments"))}
                         for c in m["tool_calls"]]
                body: dict[str, Any] = {"tool_calls": calls}
                add("assistant", (content + "\n" if content else "") + json.dumps(body, ensure_ascii=False))
            else:
                add("assistant", json.dumps({"response": content}, ensure_ascii=False))
        elif role == "tool":
            who = m.get("name") or m.get("tool_call_id") or "the tool"
            add("user", f"Result of {who}:\n{content}")
        else:
            add(str(role), content)
    systems = [m for m in out if m["role"] == "system"]
    rest = [m for m in out if m["role"] != "system"]
    if not tools:
        return out
    system = "\n\n".join([m["content"] for m in systems] + [described])
    return [{"role": "system", "content": system}, *rest]


def _call_schema(tool: dict[str, Any], args_key: str, loose: bool = False) -> dict[str, Any]:
    fn = tool["function"]
    params = {"type": "object"} if loose or not fn.get("parameters") else loosen(fn["parameters"])[0]
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key]}


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def constraint(fmt: ChatFormat, tools: list[dict[str, Any]], tool_choice: str,
               parallel: bool) -> ToolConstraint | None:
    """How decoding is held for this request; None: the model writes freely and the reply is parsed."""
    held = _constraint(fmt, tools, tool_choice, parallel, False)
    if held is None:
        return None
    loose = _constraint(fmt, tools, tool_choice, parallel, True)
    return dataclasses.replace(held, fallback=loose.schema if loose else None)


def _constraint(fmt: ChatFormat, tools: list[dict[str, Any]], tool_choice: str, parallel: bool,
                loose: bool) -> ToolConstraint | None:
    if tool_choice == "none" or not tools:
        return None
    chosen = tools if tool_choice in ("auto", "required") else [t for t in tools if t["function"]["name"] == tool_choice]
    forced = tool_choice != "auto"
    if fmt.tools in ("generic", "gemma"):
        if not forced and fmt.tools == "gemma":
            return None
        calls: dict[str, Any] = {"type": "array",
                                 "items": _one_of([_call_schema(t, "arguments", loose) for t in chosen]),
                                 "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
        call_reply = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
        if forced:
            return ToolConstraint(call_reply)
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
        return ToolConstraint({"anyOf": [call_reply, answer]})
    if fmt.tools == "hermes":
        return ToolConstraint(_one_of([_call_schema(t, "arguments", loose) for t in chosen]), "<tool_call>\n",
                              "\n</tool_call>", repeat=parallel, trigger="" if forced else "<tool_call>")
    if not forced:
        return None
    if fmt.tools == "llama3":
        return ToolConstraint(_one_of([_call_schema(t, "parameters", loose) for t in chosen]))
    items: dict[str, Any] = {"type": "array", "items": _one_of([_call_schema(t, "arguments", loose) for t in chosen]),
                             "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
    return ToolConstraint(items, "[TOOL_CALLS]")


def _has_tool_history(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def offered_tools(req: Any) -> list[dict[str, Any]] | None:
    """The tools a request (a GenerationRequest) lets the model call; None when it may call none."""
    return req.tools if req.tools and req.tool_choice != "none" else None


def prepare_tools(fmt: ChatFormat, req: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None,
                                                       ToolConstraint | None]:
    """For a chat request (a GenerationRequest): the messages to render, the tools to give the
    template, and the decoding constraint."""
    messages = req.messages or []
    offered = offered_tools(req)
    if offered is None and not _has_tool_history(messages):
        return messages, None, None
    if fmt.native_tools:
        return native_messages(fmt, messages), offered, constraint(fmt, offered or [], req.tool_choice,
                                                                    req.parallel_tool_calls)
    return (generic_messages(messages, offered or [], req.tool_choice), None,
            constraint(fmt, offered or [], req.tool_choice, req.parallel_tool_calls))
