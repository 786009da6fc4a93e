"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A thin adapter over the same GenerationRequest as chat completions: input items become chat
messages (function calls and their outputs as tool calls and tool results), `instructions` the
system message, `text.format` the response format, and the reply is parsed by the model's chat
format into output items. With `store` (the default) the conversation is kept, so a follow-up
with `previous_response_id` sees it. Streaming sends the API's semantic events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmd.backends.base import FinalEvent, GenerationRequest, Sampling, TokenEvent
from llmd.chat.parse import CallDelta, Delta, ReplyParser, ToolCall
from llmd.chat.tools import check_choice, offered_tools
from llmd.daemon.routes._common import KeepAlive, chat_format, parse_body, start_run
from llmd.daemon.routes.responses_tools import ToolMap, map_tools
from llmd.errors import BadRequest, LlmdError, NotFound


class _Format(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class _Text(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: _Format | None = None


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: _Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and ignored
    truncation: Literal["disabled", "auto"] = "disabled"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of text parts", where)
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.content[{i}] is a {kind!r} part; llmd takes text parts only "
                             "(input_text, output_text)", f"{where}.content")
        out.append(part["text"])
    return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (calls to namespaced and custom tools under the
    names the model sees them by: responses_tools.py)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role is {role!r}; use user, system, developer or assistant", where)
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content", ""), where)})
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = str(item.get("call_id") or item.get("id") or ""), str(item.get("name", ""))
            if item.get("namespace"):
                name = f"{item['namespace']}.{name}"
            args = (item.get("arguments") or "{}" if kind == "function_call"
                    else json.dumps({"input": item.get("input", "")}, ensure_ascii=False))
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            names[call_id] = name
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            cid = item.get("call_id", "")
            out.append({"role": "tool", "tool_call_id": cid, "name": names.get(cid, ""),
                        "content": output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again, as chat templates drop it
        else:
            raise BadRequest(f"{where} is a {kind!r} item; llmd takes message, function_call, "
                             "function_call_output, custom_tool_call, custom_tool_call_output and reasoning "
                             "items", where)
    return out


def _tools(body: ResponsesBody) -> tuple[ToolMap, str]:
    tools = map_tools(body.tools)
    choice = body.tool_choice or "auto"
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if choice.get("type") not in ("function", "custom") or not name:
            raise BadRequest("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                             "tool_choice")
        choice = tools.model_name(name, choice.get("namespace"))
    check_choice(tools.tools or None, choice)
    return tools, choice


def _response_format(body: ResponsesBody) -> dict[str, Any] | None:
    f = body.text.format if body.text else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.schema_ is None:
        raise BadRequest("text.format json_schema needs a schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"schema": f.schema_}}


class _Output:
    """Builds the output items, in order, from parser deltas; yields the stream events for each."""

    def __init__(self, tools: ToolMap) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0
        self.tools = tools
        self.live: dict[int, dict[str, Any]] = {}  # function calls streamed as decoded, by call index

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.items.index(item)
        item["status"] = "completed"
        evs = []
        if item["type"] == "message":
            part = item["content"][0]
            evs += [self.event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                               part=part)]
        else:
            part = item["content"][0]
            evs.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=part["text"]))
        evs.append(self.event("response.output_item.done", output_index=idx, item=item))
        return evs

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        evs = []
        if self.open is None or self.open["type"] != kind:
            evs += self._close()
            if kind == "message":
                item: dict[str, Any] = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                                        "role": "assistant", "content": []}
            else:
                item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "content": []}
            self.items.append(item)
            self.open = item
            idx = len(self.items) - 1
            evs.append(self.event("response.output_item.added", output_index=idx, item=dict(item, content=[])))
            part = ({"type": "output_text", "text": "", "annotations": []} if kind == "message"
                    else {"type": "reasoning_text", "text": ""})
            item["content"].append(part)
            if kind == "message":
                evs.append(self.event("response.content_part.added", item_id=item["id"], output_index=idx,
                                      content_index=0, part=dict(part)))
        idx = self.items.index(self.open)
        self.open["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        evs.append(self.event(name, item_id=self.open["id"], output_index=idx, content_index=0, delta=text,
                              **({"logprobs": []} if kind == "message" else {})))
        return evs

    def add(self, d: Delta) -> list[dict[str, Any]]:
        evs = []
        if d.reasoning:
            evs += self._text("reasoning", d.reasoning)
        if d.content:
            evs += self._text("message", d.content)
        evs += self._pieces(d.call_deltas)
        if d.tool_calls:
            evs += self._close()
            for i, c in enumerate(d.tool_calls):
                evs += self._done(self.live[i], c) if i in self.live else self._calls([c])
        return evs

    def _pieces(self, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        """Function calls as they are decoded: the item, then its arguments in deltas. Custom tool
        calls wait for the end (their input is a string inside the arguments' JSON)."""
        evs = []
        for d in deltas:
            if d.name is not None:
                item = self.tools.output_item(d.id, uuid.uuid4().hex, d.name, "")
                if item["type"] != "function_call":
                    continue
                evs += self._close()
                self.items.append({**item, "status": "in_progress"})
                self.live[d.index] = self.items[-1]
                evs.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=dict(self.items[-1])))
            live = self.live.get(d.index)
            if live is not None and d.arguments:
                live["arguments"] += d.arguments
                evs.append(self.event("response.function_call_arguments.delta", item_id=live["id"],
                                      output_index=self.items.index(live), delta=d.arguments))
        return evs

    def _done(self, item: dict[str, Any], c: ToolCall) -> list[dict[str, Any]]:
        idx = self.items.index(item)
        item.update(arguments=c.arguments, status="completed")
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                           name=item["name"], arguments=c.arguments),
                self.event("response.output_item.done", output_index=idx, item=item)]

    def _calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        evs = []
        for c in calls:
            item = self.tools.output_item(c.id, uuid.uuid4().hex, c.name, c.arguments)
            self.items.append(item)
            idx = len(self.items) - 1
            if item["type"] == "custom_tool_call":
                evs += [self.event("response.output_item.added", output_index=idx,
                                   item={**item, "input": "", "status": "in_progress"}),
                        self.event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx,
                                   delta=item["input"]),
                        self.event("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                                   input=item["input"])]
            else:
                evs += [self.event("response.output_item.added", output_index=idx,
                                   item={**item, "arguments": "", "status": "in_progress"}),
                        self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                                   delta=c.arguments),
                        self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                   name=item["name"], arguments=c.arguments)]
            evs.append(self.event("response.output_item.done", output_index=idx, item=item))
        return evs

    def finish(self) -> list[dict[str, Any]]:
        """The reply's end: the open text item closes, and a call streamed as it was decoded that the
        parser never finished (the reply was cut inside it, or it did not parse and came back as
        text) ends `incomplete`: no item is left in_progress."""
        evs = self._close()
        for item in self.live.values():
            if item.get("status") == "in_progress":
                item["status"] = "incomplete"
                evs.append(self.event("response.output_item.done", output_index=self.items.index(item), item=item))
        return evs


def _response(rid: str, body: ResponsesBody, model: str, created: int, output: list[dict[str, Any]],
              final: FinalEvent | None, choice: str) -> dict[str, Any]:
    status = "in_progress" if final is None else "incomplete" if final.finish_reason == "length" else "completed"
    u = final.usage if final else None
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "metadata": body.metadata or {},
        "tools": body.tools or [],
        "tool_choice": choice if choice in ("none", "auto", "required") else {"type": "function", "name": choice},
        "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
        "store": body.store, "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                                 if body.text and body.text.format else {"type": "text"})},
        "reasoning": {"effort": None, "summary": None}, "truncation": body.truncation, "user": body.user,
        "usage": None if u is None else {
            "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens},
    }


def _reply_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reply as the chat history stores it: calls under the names the model sees."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [c for m in input_messages([i for i in output if i["type"] in ("function_call", "custom_tool_call")])
             for c in m.get("tool_calls", [])]  # every call of a parallel reply, not only each message's first
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def _sse(ev: dict[str, Any]) -> bytes:
    return (f"event: {ev['type']}\ndata: ".encode() + json.dumps(ev, ensure_ascii=False, separators=(",", ":")).encode()
            + b"\n\n")


async def create(request: Request) -> Response:
    body = await parse_body(request, ResponsesBody, nulls_are_unset=True)
    store = request.app.state.stored_responses
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        found = await asyncio.to_thread(store.get, body.previous_response_id) if store else None
        if found is None:
            raise NotFound(f"no stored response {body.previous_response_id!r}: it was never stored (store: false), "
                           "was deleted, or is older than 30 days", "previous_response_id")
        history = found[0]
    conversation = history + input_messages(body.input)
    if not conversation:
        raise BadRequest("input is empty; send a string or at least one message item", "input")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    toolmap, choice = _tools(body)
    tools = toolmap.tools or None
    if toolmap.ignored:  # hosted tools: named in X-LLMD-Ignored, as unknown fields are
        request.state.ignored = [*getattr(request.state, "ignored", []), *toolmap.ignored]
    fmt_json = _response_format(body)
    if tools and choice != "none" and fmt_json:
        raise BadRequest("send either tools or a JSON text.format: a reply cannot be held to both", "text.format")
    req = GenerationRequest(
        id=uuid.uuid4().hex, messages=messages, max_tokens=body.max_output_tokens,
        sampling=Sampling(temperature=body.temperature, top_p=body.top_p, seed=body.seed),
        response_format=fmt_json, tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls)
    run = await start_run(request, body.model, req, "openai", stream=body.stream)
    rid = "resp_" + req.id
    created = int(time.time())
    parser = ReplyParser(await chat_format(request, run.answered_by), offered_tools(req), stream_calls=body.stream)
    out = _Output(toolmap)

    async def remember(resp: dict[str, Any]) -> None:
        if body.store and store is not None:
            await asyncio.to_thread(store.put, rid, run.model, conversation + _reply_messages(resp["output"]), resp)

    if not body.stream:
        text, final = await run.collect(request)
        out.add(parser.feed(text, tuple(run.tool_calls)))
        out.add(parser.finish())
        out.finish()
        resp = _response(rid, body, run.model, created, out.items, final, choice)
        await remember(resp)
        return JSONResponse(resp, headers=run.headers)

    async def events() -> AsyncIterator[bytes]:
        yield _sse(out.event("response.created", response=_response(rid, body, run.model, created, [], None,
                                                                     choice)))
        yield _sse(out.event("response.in_progress", response=_response(rid, body, run.model, created, [], None,
                                                                         choice)))
        try:
            async for ev in run:
                if isinstance(ev, KeepAlive):
                    # an event, not the SSE comment other routes send: Codex's idle timeout (300 s)
                    # counts events only, and gave up on an 8.6k-token cold prompt and sent it again
                    yield _sse(out.event("response.in_progress", response=_response(
                        rid, body, run.model, created, [], None, choice)))
                elif isinstance(ev, TokenEvent):
                    for e in out.add(parser.feed(ev.text, ev.tool_calls)):
                        yield _sse(e)
        except LlmdError as err:
            yield _sse(out.event("error", code=err.code, message=err.message, param=err.param))
            return
        for e in out.add(parser.finish()) + out.finish():
            yield _sse(e)
        resp = _response(rid, body, run.model, created, out.items, run.final, choice)
        await remember(resp)
        # response.completed also for a reply cut at max_output_tokens (its status says incomplete):
        # the openai SDK's stream helpers wait for that event and fail on response.incomplete
        yield _sse(out.event("response.completed", response=resp))

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **run.headers})


async def get(request: Request) -> Response:
    store = request.app.state.stored_responses
    rid = request.path_params["id"]
    found = await asyncio.to_thread(store.get, rid) if store else None
    if found is None:
        raise NotFound(f"no stored response {rid!r}", "id")
    return JSONResponse(found[1])


async def delete(request: Request) -> Response:
    store = request.app.state.stored_responses
    rid = request.path_params["id"]
    if store is None or not await asyncio.to_thread(store.delete, rid):
        raise NotFound(f"no stored response {rid!r}", "id")
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


routes = [
    Route("/v1/responses", create, methods=["POST"]),
    Route("/v1/responses/{id:str}", get, methods=["GET"]),
    Route("/v1/responses/{id:str}", delete, methods=["DELETE"]),
]
