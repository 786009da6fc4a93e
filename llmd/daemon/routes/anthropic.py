"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

The same GenerationRequest as the other APIs: text blocks become message contents, `tool_use`
and `tool_result` blocks become tool calls and tool results, `system` the system message, and
the reply is parsed by the model's chat format into text, thinking and tool_use blocks.
Streaming sends Anthropic's events (message_start, content_block_*, message_delta, message_stop).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmd.backends.base import GenerationRequest, Sampling, TokenEvent, Usage
from llmd.chat.parse import Delta, ReplyParser
from llmd.chat.tools import check_choice, offered_tools
from llmd.daemon.routes._common import (
    KeepAlive,
    Run,
    chat_format,
    normalize_tools,
    note_no_thinking,
    parse_body,
    start_run,
)
from llmd.daemon.security import error_body
from llmd.errors import BadRequest, LlmdError


class _ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: _ToolChoice | None = None
    stop_sequences: list[str] | None = None
    # omitted: the API's temperature (1.0) with llama-server's tail cut (top_k 40, top_p 0.95,
    # min_p 0.05); see _sampling
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted and ignored (user_id)
    thinking: dict[str, Any] | None = None  # reasoning is split out when the template writes it
    output_config: dict[str, Any] | None = None  # format: {"type": "json_schema", "schema": ...}


class CountBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def _blocks_text(blocks: Any, where: str, references: list[str] | None = None) -> str:
    """Text blocks joined; tool_reference blocks' names go to `references` where it is given."""
    if isinstance(blocks, str):
        return blocks
    if blocks is not None and not isinstance(blocks, list):
        raise BadRequest(f"{where} is a {type(blocks).__name__}; send a string or a list of text blocks", where)
    out = []
    for i, b in enumerate(blocks or []):
        if references is not None and isinstance(b, dict) and b.get("type") == "tool_reference":
            references.append(str(b.get("tool_name", "")))
            continue
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            takes = "text and tool_reference blocks" if references is not None else "text blocks"
            raise BadRequest(f"{where}[{i}] is a {kind!r} block here; llmd takes {takes}", where)
        out.append(b["text"])
    return "".join(out)


def _result_text(content: Any, where: str) -> str:
    """A tool_result's content as text. Besides text it may hold tool_reference blocks: Claude
    Code's ToolSearch answers with them (the tools it found, which Anthropic's API then loads for the
    model). llmd shows the model every tool a request declares, deferred ones included, so a
    reference only needs to say which tools were found; refused, it failed the whole request with a
    400 (CI, stop 61: Claude Code's Read task, three times in one run)."""
    found: list[str] = []
    text = _blocks_text(content, where, found)
    if found:
        text += ("\n" if text else "") + "Tools found, now available to call: " + ", ".join(found)
    return text


# Claude Code opens its system prompt with a block for Anthropic's billing whose value changes with
# every prompt ("cc_version=2.1.332.988", then ".34c"): at the very start of the prompt it would
# make every session's 12,000-token prefix new. It says nothing to the model: left out.
_BILLING = "x-anthropic-billing-header:"


def _system_text(system: Any) -> str:
    if isinstance(system, list):
        system = [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(_BILLING))]
    return _blocks_text(system, "system")


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages (and system) as chat messages."""
    out: list[dict[str, Any]] = []
    if system and (prompt := _system_text(system)):
        out.append({"role": "system", "content": prompt})
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "system":  # Claude Code sends one after the first user turn (its environment):
            # put before that user turn, so the conversation still ends with the user's words (a
            # small model answered the system text instead) and what comes before it (system
            # prompt, tools) stays a prefix shared by every session
            note = {"role": "system", "content": _blocks_text(m.get("content", ""), f"messages[{i}].content")}
            at = len(out) - 1 if out and out[-1]["role"] == "user" else len(out)
            out.insert(at, note)
            continue
        if role not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}].role is {role!r}; use user, assistant or system", f"messages[{i}].role")
        content = m.get("content", "")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of blocks", f"messages[{i}].content")
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                names[b.get("id", "")] = b.get("name", "")
                calls.append({"id": b.get("id", ""), "type": "function",
                              "function": {"name": b.get("name", ""),
                                           "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                result = _result_text(b.get("content", ""), f"{where}.content")
                if b.get("is_error"):
                    result = "Error: " + result
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""),
                            "name": names.get(b.get("tool_use_id", ""), ""), "content": result})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not shown to the model again, as chat templates drop it
            else:
                raise BadRequest(f"{where} is a {kind!r} block; llmd takes text, tool_use (assistant), "
                                 "tool_result (user) and thinking blocks", where)
        if text or calls or not any(b.get("type") == "tool_result" for b in blocks if isinstance(b, dict)):
            msg: dict[str, Any] = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(tools: list[dict[str, Any]] | None, choice: _ToolChoice | None) -> dict[str, Any]:
    openai_shaped = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                       "parameters": t.get("input_schema")}}
                     if isinstance(t, dict) and t.get("type", "custom") == "custom" else
                     {"type": t.get("type") if isinstance(t, dict) else "?", "function": None}
                     for t in tools or []]
    normalized = normalize_tools(openai_shaped)
    c = choice or _ToolChoice()
    name = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or c.name or ""
    if c.type == "tool" and not c.name:
        raise BadRequest("tool_choice of type tool needs a name", "tool_choice.name")
    check_choice(normalized, name)
    return {"tools": normalized, "tool_choice": name, "parallel_tool_calls": not c.disable_parallel_tool_use}


def _sampling(body: MessagesBody) -> Sampling:
    """What the client sent; what it left out as llama-server fills it in (top_k 40, top_p 0.95,
    min_p 0.05; the API's own temperature, 1.0). Claude Code sends no sampling field at all, and
    sampling the 1.5B's whole distribution at 1.0 over its ~12k-token prompt mostly wrote prose
    about a tool instead of calling it: `claude -p "Use the Read tool to read notes.txt..."` fed a
    tool result back in 0 of 3 runs (and 0 of 5 in a CI run), 3 of 6 with the tail cut."""
    return Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=0.95 if body.top_p is None else body.top_p,
                    top_k=40 if body.top_k is None else body.top_k, min_p=0.05)


def _output_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if not fmt:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise BadRequest('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def _usage(u: Usage | None) -> dict[str, Any]:
    if u is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def _stop_reason(finish: str, calls: bool) -> str:
    return "max_tokens" if finish == "length" else "tool_use" if calls else "end_turn"


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}, ensure_ascii=False,
                                                          separators=(",", ":")).encode() + b"\n\n"


class _Blocks:
    """Content blocks in order, from parser deltas; the stream events that open, fill and close them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None
        self.live: dict[int, int] = {}  # call index -> its tool_use block, streamed as decoded

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"index": len(self.blocks) - 1})]

    def _text(self, kind: str, text: str) -> list[bytes]:
        evs = []
        key = "thinking" if kind == "thinking" else "text"
        if self.open != kind:
            evs += self.close()
            block = {"type": kind, key: ""} if kind == "text" else {"type": kind, key: "", "signature": ""}
            self.blocks.append(block)
            self.open = kind
            evs.append(_sse("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)}))
        self.blocks[-1][key] += text
        evs.append(_sse("content_block_delta", {"index": len(self.blocks) - 1,
                                                "delta": {"type": f"{key}_delta", key: text}}))
        return evs

    def add(self, d: Delta) -> list[bytes]:
        evs = []
        if d.reasoning:
            evs += self._text("thinking", d.reasoning)
        if d.content:
            evs += self._text("text", d.content)
        for piece in d.call_deltas:  # a tool_use block opened at its name, its input in partial JSON
            if piece.name is not None:
                evs += self.close()
                self.blocks.append({"type": "tool_use", "id": "toolu_" + piece.id.removeprefix("call_"),
                                    "name": piece.name, "input": {}})
                self.live[piece.index] = len(self.blocks) - 1
                self.open = "tool_use"
                evs.append(_sse("content_block_start", {"index": len(self.blocks) - 1,
                                                        "content_block": dict(self.blocks[-1])}))
            if piece.arguments:
                evs.append(_sse("content_block_delta", {"index": self.live[piece.index], "delta": {
                    "type": "input_json_delta", "partial_json": piece.arguments}}))
        for n, c in enumerate(d.tool_calls):
            if n in self.live:
                self.blocks[self.live[n]]["input"] = c.arguments_object
                continue
            evs += self.close()
            block = {"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name,
                     "input": c.arguments_object}
            self.blocks.append(block)
            i = len(self.blocks) - 1
            evs += [_sse("content_block_start", {"index": i, "content_block": {**block, "input": {}}}),
                    _sse("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                       "partial_json": c.arguments}}),
                    _sse("content_block_stop", {"index": i})]
        return evs


FIRST_STREAM_EVENT_S = 0.5


def _asked_thinking(body: MessagesBody) -> list[str]:
    """The fields of `body` that ask for reasoning."""
    asked = []
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        asked.append("thinking")
    if "effort" in (body.output_config or {}):
        asked.append("output_config.effort")
    return asked


async def messages(request: Request) -> Response:
    body = await parse_body(request, MessagesBody)
    tools = _tools(body.tools, body.tool_choice)
    fmt = _output_format(body.output_config)
    if fmt and tools["tools"] and tools["tool_choice"] != "none":
        raise BadRequest("send either tools or output_config.format: a reply cannot be held to both",
                         "output_config.format")
    req = GenerationRequest(
        id=uuid.uuid4().hex, messages=chat_messages(body.system, body.messages), max_tokens=body.max_tokens,
        sampling=_sampling(body), stop=tuple(body.stop_sequences or ()), response_format=fmt, **tools)
    # message_start goes out at once: Claude Code's SDK drops `ping`, and its idle timer
    # (CLAUDE_STREAM_IDLE_TIMEOUT_MS) counts from the last event it yielded; what fails in the first
    # half second (a bad schema, a prompt too long) is still a 4xx
    run = await start_run(request, body.model, req, "anthropic", stream=body.stream, first_wait=FIRST_STREAM_EVENT_S)
    mid = "msg_" + req.id
    fmt_of_model = await chat_format(request, run.answered_by)
    if not fmt_of_model.thinking:
        note_no_thinking(request, run.answered_by, _asked_thinking(body))
    parser = ReplyParser(fmt_of_model, offered_tools(req), stream_calls=body.stream)
    blocks = _Blocks()

    def message(final_usage: Usage | None, stop: str | None) -> dict[str, Any]:
        return {"id": mid, "type": "message", "role": "assistant", "model": run.model, "content": blocks.blocks,
                "stop_reason": stop, "stop_sequence": None, "usage": _usage(final_usage)}

    if not body.stream:
        text, final = await run.collect(request)
        blocks.add(parser.feed(text, tuple(run.tool_calls)))
        blocks.add(parser.finish())
        calls = any(b["type"] == "tool_use" for b in blocks.blocks)
        return JSONResponse(message(final.usage, _stop_reason(final.finish_reason, calls)), headers=run.headers)

    async def events() -> AsyncIterator[bytes]:
        yield _sse("message_start", {"message": {**message(None, None), "content": []}})
        yield _sse("ping", {})
        try:
            async for ev in run:
                if isinstance(ev, KeepAlive):
                    yield _sse("ping", {})  # Anthropic's own keep-alive event
                elif isinstance(ev, TokenEvent):
                    for e in blocks.add(parser.feed(ev.text, ev.tool_calls)):
                        yield e
        except LlmdError as err:
            yield _sse("error", {"error": error_body("/v1/messages", err)["error"]})
            return
        for e in blocks.add(parser.finish()) + blocks.close():
            yield e
        assert run.final is not None
        calls = any(b["type"] == "tool_use" for b in blocks.blocks)
        yield _sse("message_delta", {"delta": {"stop_reason": _stop_reason(run.final.finish_reason, calls),
                                               "stop_sequence": None}, "usage": _usage(run.final.usage)})
        yield _sse("message_stop", {})

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **run.headers})


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens, counted by the model's own tokenizer on its rendered template. Counting
    prefills the prompt (max_tokens 0), so the request that follows finds it cached."""
    body = await parse_body(request, CountBody)
    tools = _tools(body.tools, None)
    req = GenerationRequest(id=uuid.uuid4().hex, messages=chat_messages(body.system, body.messages), max_tokens=0,
                            sampling=Sampling(temperature=0.0), **tools)
    run: Run = await start_run(request, body.model, req, "anthropic")
    _, final = await run.collect(request)
    return JSONResponse({"input_tokens": final.usage.prompt_tokens})


async def hello(request: Request) -> Response:
    """The reachability probe Claude Code sends to its base URL at start (HEAD /api/hello)."""
    return Response("hello", media_type="text/plain")


routes = [
    Route("/api/hello", hello, methods=["GET", "HEAD"]),
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
