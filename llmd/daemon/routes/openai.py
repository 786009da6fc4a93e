"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

A thin adapter: validate the body, build one GenerationRequest, and shape the events as
OpenAI does (one JSON object, or SSE chunks ending with `data: [DONE]`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmd.backends.base import FimPrompt, GenerationRequest, Sampling, TokenEvent, Usage
from llmd.chat.fim import cursor_indent
from llmd.chat.parse import CallDelta, ToolCall, reply_parser
from llmd.chat.tools import check_choice, offered_tools
from llmd.config import SpeculationMode
from llmd.daemon.routes._common import (
    KeepAlive,
    Run,
    chat_format,
    normalize_tools,
    parse_body,
    start_run,
    text_of,
)
from llmd.daemon.security import error_body
from llmd.errors import BadRequest, LlmdError

# ---- request bodies ---------------------------------------------------------------------------


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    type: str = "function"
    function: _Function


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class _NamedChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: _Function | None = None
    name: str | None = None  # the Responses API's flat shape


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not use (user, logprobs...)
    model: str | None = None
    # 0: prefill the prompt into the cache and answer nothing (warm it while the user is still typing)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    response_format: _ResponseFormat | None = None
    logprobs: bool | int | None = None  # chat: true/false; completions: how many top tokens (0-5)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    cache_prompt: bool = True  # llmd extension: false computes the whole prompt, reusing nothing
    speculation: SpeculationMode | None = None  # llmd extension; None: the daemon's default


class ChatBody(_Common):
    messages: list[_Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedChoice | None = None
    parallel_tool_calls: bool = True


def chat_messages(messages: list[_Message]) -> list[dict[str, Any]]:
    """The messages as the engine takes them: text contents, tool calls and results kept."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": text_of(m.content, f"messages[{i}]")}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments
                                             if isinstance(c.function.arguments, str)
                                             else json.dumps(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def tool_fields(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool,
                has_format: bool) -> dict[str, Any]:
    """GenerationRequest's tool fields from an OpenAI-style request, checked."""
    normalized = normalize_tools(tools)
    if isinstance(choice, _NamedChoice):
        name = choice.function.name if choice.function else choice.name
        if not name:
            raise BadRequest("tool_choice names no function; send {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}", "tool_choice")
        choice = name
    choice = choice or "auto"
    check_choice(normalized, choice)
    if normalized and choice != "none" and has_format:
        raise BadRequest("send either tools or a JSON response_format: a reply cannot be held to both "
                         "(or set tool_choice to none)", "response_format")
    return {"tools": normalized, "tool_choice": choice, "parallel_tool_calls": parallel}


class CompletionBody(_Common):
    prompt: str | list[str]
    suffix: str | None = None  # the text after the completion: fill in the middle (a FIM model)


def _top_logprobs(body: _Common) -> int | None:
    if isinstance(body, CompletionBody):  # completions: logprobs is the number of top tokens
        if body.logprobs is None or body.logprobs is False:
            return None
        if body.logprobs is True or not 0 <= int(body.logprobs) <= 5:
            raise BadRequest("logprobs for completions is a number of top tokens, 0 to 5", "logprobs")
        return int(body.logprobs)
    if body.logprobs is not None and not isinstance(body.logprobs, bool):
        raise BadRequest("logprobs for chat is true or false; the number of top tokens goes in top_logprobs",
                         "logprobs")
    if not body.logprobs:
        if body.top_logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return body.top_logprobs or 0


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    def one(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return {"content": [{**one(t, lp), "top_logprobs": [one(a, b) for a, b in top]} for t, lp, top in entries],
            "refusal": None}


def completion_logprobs(entries: list[Any], start: int = 0) -> dict[str, Any]:
    offsets, at = [], start
    for t, _, _ in entries:
        offsets.append(at)
        at += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}


def _generation(body: _Common, **what: Any) -> GenerationRequest:
    if body.n != 1:
        raise BadRequest(f"n={body.n}: llmd returns one choice per request; send n=1 (or omit it)", "n")
    if body.max_tokens is not None and body.max_completion_tokens is not None and body.max_tokens != body.max_completion_tokens:
        raise BadRequest("max_tokens and max_completion_tokens differ; send one of them", "max_completion_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    rf = body.response_format
    response_format: dict[str, Any] | None = None
    if rf is not None and rf.type != "text":
        response_format = {"type": rf.type}
        if rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise BadRequest("response_format json_schema needs json_schema.schema", "response_format.json_schema")
            response_format["json_schema"] = {"schema": rf.json_schema.schema_}
    return GenerationRequest(
        id=uuid.uuid4().hex,
        top_logprobs=_top_logprobs(body),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        sampling=Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                          seed=body.seed, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty),
        stop=stop,
        response_format=response_format,
        cache_prompt=body.cache_prompt,
        speculation=body.speculation or "",
        **what,
    )


# ---- responses ----------------------------------------------------------------------------------


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"accepted_prediction_tokens": u.accepted_tokens,
                                      "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens},
    }


def _finish_reason(reason: str, calls: bool = False) -> str:
    return "length" if reason == "length" else "tool_calls" if calls else "stop"


def tool_calls_json(calls: list[ToolCall], streamed: bool = False, first: int = 0) -> list[dict[str, Any]]:
    return [{**({"index": i} if streamed else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls, first)]


def call_delta_json(d: CallDelta) -> dict[str, Any]:
    """One streamed piece of a call, as OpenAI sends it: id, type and name with the first."""
    head = {"id": d.id, "type": "function"} if d.name is not None else {}
    fn = {"name": d.name, "arguments": d.arguments} if d.name is not None else {"arguments": d.arguments}
    return {"index": d.index, **head, "function": fn}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _respond(run: Run, body: _Common, chat: bool) -> Response:
    rid = ("chatcmpl-" if chat else "cmpl-") + run.req.id
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    parser = (reply_parser(await chat_format(run.request, run.answered_by), offered_tools(run.req),
                           stream_calls=body.stream) if chat and run.request is not None else None)
    if not body.stream:
        text, final = await run.collect(run.request)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(final.finish_reason), "logprobs": None}
        if parser is not None:
            reply = parser.parse(text, tuple(run.tool_calls))
            message: dict[str, Any] = {"role": "assistant", "content": reply.content or None if reply.tool_calls
                                       else reply.content}
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = tool_calls_json(reply.tool_calls)
                choice["finish_reason"] = _finish_reason(final.finish_reason, True)
            choice["message"] = message
        elif chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if run.req.top_logprobs is not None:
            choice["logprobs"] = chat_logprobs(run.logprobs) if chat else completion_logprobs(run.logprobs)
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": run.model,
                             "choices": [choice], "usage": usage_json(final.usage)}, headers=run.headers)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    offset = 0

    def chunk(delta: dict[str, Any] | str, finish: str | None, logprobs: Any = ()) -> dict[str, Any]:
        nonlocal offset
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if logprobs:
            c["logprobs"] = chat_logprobs(list(logprobs)) if chat else completion_logprobs(list(logprobs), offset)
            offset += sum(len(t) for t, _, _ in logprobs)
        if chat:
            c["delta"] = delta
        else:
            c["text"] = delta
        out: dict[str, Any] = {"id": rid, "object": chunk_obj, "created": created, "model": run.model, "choices": [c]}
        if include_usage:
            out["usage"] = None
        return out

    async def stream() -> AsyncIterator[bytes]:
        if chat:
            yield _sse(chunk({"role": "assistant", "content": ""}, None))
        calls = False
        try:
            async for ev in run:
                if isinstance(ev, KeepAlive):  # an SSE comment: clients skip it, connections stay open
                    yield b": keep-alive\n\n"
                elif isinstance(ev, TokenEvent):
                    if parser is None:
                        yield _sse(chunk({"content": ev.text} if chat else ev.text, None, ev.logprobs))
                        continue
                    d = parser.feed(ev.text, ev.tool_calls)
                    if d.reasoning:
                        yield _sse(chunk({"reasoning_content": d.reasoning}, None))
                    if d.content or ev.logprobs:
                        yield _sse(chunk({"content": d.content}, None, ev.logprobs))
                    if d.call_deltas:
                        calls = True
                        yield _sse(chunk({"tool_calls": [call_delta_json(c) for c in d.call_deltas]}, None))
        except LlmdError as e:  # after the first token the status is sent: report in the stream
            yield _sse(error_body("/v1", e))
            yield b"data: [DONE]\n\n"
            return
        assert run.final is not None
        if parser is not None:
            d = parser.finish()
            if d.reasoning:
                yield _sse(chunk({"reasoning_content": d.reasoning}, None))
            if d.content:
                yield _sse(chunk({"content": d.content}, None))
            if d.call_deltas:
                yield _sse(chunk({"tool_calls": [call_delta_json(c) for c in d.call_deltas]}, None))
            rest = d.tool_calls[parser.n_streamed:]  # calls not streamed as they were decoded
            if rest:
                yield _sse(chunk({"tool_calls": tool_calls_json(rest, streamed=True, first=parser.n_streamed)}, None))
            calls = calls or bool(d.tool_calls)
        yield _sse(chunk({} if chat else "", _finish_reason(run.final.finish_reason, calls)))
        if include_usage:
            yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": run.model, "choices": [],
                        "usage": usage_json(run.final.usage)})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={**SSE_HEADERS, **run.headers})


# ---- handlers -----------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatBody, nulls_are_unset=True)
    tools = tool_fields(body.tools, body.tool_choice, body.parallel_tool_calls,
                        body.response_format is not None and body.response_format.type != "text")
    req = _generation(body, messages=chat_messages(body.messages), **tools)
    run = await start_run(request, body.model, req, "openai", stream=body.stream)
    return await _respond(run, body, chat=True)


async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionBody, nulls_are_unset=True)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest(f"prompt is a list of {len(prompt)} strings; llmd completes one prompt per request", "prompt")
        prompt = prompt[0]
    if body.suffix is not None:  # fill in the middle: the prompt is the code before the cursor
        req = _generation(body, fim=FimPrompt(prefix=prompt, suffix=body.suffix, n_indent=cursor_indent(prompt)))
    else:
        req = _generation(body, prompt=prompt, raw=True)
    run = await start_run(request, body.model, req, "openai", stream=body.stream)
    return await _respond(run, body, chat=False)


async def warm(request: Request) -> Response:
    """POST /llmd/warm: prefill a chat (messages) or a raw prompt into the engine's caches and
    generate nothing, so an app can warm the next request while its user is still typing. Takes
    the body of /v1/chat/completions or /v1/completions; answers the prompt and cached token counts."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        data = {}  # parse_body reports the bad JSON
    is_chat = not isinstance(data, dict) or "messages" in data or "prompt" not in data
    body: _Common = await parse_body(request, ChatBody if is_chat else CompletionBody)
    if isinstance(body, ChatBody):
        tools = tool_fields(body.tools, body.tool_choice, body.parallel_tool_calls, False)
        req = _generation(body.model_copy(update={"max_tokens": 0, "max_completion_tokens": None}),
                          messages=chat_messages(body.messages), **tools)
    else:
        assert isinstance(body, CompletionBody)
        prompt = body.prompt if isinstance(body.prompt, str) else "".join(body.prompt)
        req = _generation(body.model_copy(update={"max_tokens": 0, "max_completion_tokens": None}), prompt=prompt,
                          raw=True)
    run = await start_run(request, body.model, req, "openai")
    _, final = await run.collect()
    u = final.usage
    return JSONResponse({"model": run.model, "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                         "prefill_s": round(u.prefill_s, 4)})


async def list_models(request: Request) -> Response:
    registry = request.app.state.registry
    data = [{"id": m["name"], "object": "model", "created": int(m["added_at"]), "owned_by": "llmd"}
            for m in registry.list()]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    m = request.app.state.registry.get(request.path_params["id"])
    return JSONResponse({"id": m["name"], "object": "model", "created": int(m["added_at"]), "owned_by": "llmd"})


routes = [
    Route("/v1/models/{id:path}", get_model, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/llmd/warm", warm, methods=["POST"]),
]
