"""Ollama-compatible routes: /api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version.

Same engine path as the OpenAI routes; Ollama's field names (options.num_predict, num_ctx...),
NDJSON streaming by default, and durations in nanoseconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmd import __version__
from llmd.backends.base import FimPrompt, GenerationRequest, Sampling, TokenEvent
from llmd.chat.fim import cursor_indent, ollama_template
from llmd.chat.formats import detect
from llmd.chat.parse import ToolCall, reply_parser
from llmd.chat.tools import offered_tools
from llmd.config import SpeculationMode, fixed_ctx
from llmd.daemon.routes._common import (
    KeepAlive,
    Run,
    canonical_name,
    chat_format,
    fim_spellings,
    normalize_tools,
    note_no_thinking,
    parse_body,
    start_run,
)
from llmd.daemon.routes.openai import chat_logprobs
from llmd.errors import BadRequest, LlmdError
from llmd.models.memory import load_ctx

log = logging.getLogger("llmd.requests")
# the Ollama API version whose routes and shapes these follow (with the Responses API that Ollama
# serves since 0.13.4: Codex CLI's --oss checks for at least that)
OLLAMA_COMPAT_VERSION = "0.13.5"


class _Options(BaseModel):
    model_config = ConfigDict(extra="allow")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    num_predict: int | None = None
    num_ctx: int | None = Field(default=None, ge=1)
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    speculation: SpeculationMode | None = None  # llmd extension


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    function: _Function


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""  # null: no text (Ollama accepts it)
    images: list[str] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_name: str | None = None  # on a tool result: which tool answered
    thinking: str | None = None


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    stream: bool = True
    format: Literal["json", ""] | dict[str, Any] | None = None  # "": unset, as Ollama treats it
    options: _Options | None = None
    keep_alive: float | int | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatBody(_Base):
    messages: list[_Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    think: bool | Literal["low", "medium", "high"] | None = None


def _messages(body: ChatBody) -> list[dict[str, Any]]:
    out = []
    for m in body.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments, ensure_ascii=False)}} for c in m.tool_calls]
        if m.tool_name:
            d["name"] = m.tool_name
        out.append(d)
    return out


class GenerateBody(_Base):
    prompt: str = ""
    suffix: str | None = None  # the code after the cursor: fill in the middle (Continue, Twinny)
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None


def _generation(body: _Base, **what: Any) -> GenerationRequest:
    o = body.options or _Options()
    fmt: dict[str, Any] | None = None
    if body.format == "json":
        fmt = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fmt = {"type": "json_schema", "json_schema": {"schema": body.format}}
    num_predict = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return GenerationRequest(
        id=uuid.uuid4().hex,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        max_tokens=num_predict,
        sampling=Sampling(
            temperature=0.8 if o.temperature is None else o.temperature,
            top_p=0.9 if o.top_p is None else o.top_p,
            top_k=40 if o.top_k is None else o.top_k,
            min_p=0.0 if o.min_p is None else o.min_p,
            seed=o.seed,
            presence_penalty=o.presence_penalty or 0.0,
            frequency_penalty=o.frequency_penalty or 0.0,
            repeat_penalty=1.0 if o.repeat_penalty is None else o.repeat_penalty,
        ),
        stop=tuple(o.stop or ()),
        response_format=fmt,
        ctx_limit=o.num_ctx,
        speculation=o.speculation or "",
        **what,
    )


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _final_fields(run: Run) -> dict[str, Any]:
    import time

    assert run.final is not None
    u = run.final.usage
    return {
        "done": True,
        "done_reason": "length" if run.final.finish_reason == "length" else "stop",
        "total_duration": int((time.perf_counter() - run.t_start) * 1e9),
        "load_duration": int(run.admission.load_s * 1e9),
        "prompt_eval_count": u.prompt_tokens,
        "prompt_eval_duration": int(u.prefill_s * 1e9),
        "eval_count": u.completion_tokens,
        "eval_duration": int(u.decode_s * 1e9),
    }


def _ndjson(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": c.arguments_object}}
            for i, c in enumerate(calls)]


async def _respond(run: Run, stream: bool, chat: bool) -> Response:
    parser = reply_parser(await chat_format(run.request, run.answered_by), offered_tools(run.req)) \
        if run.request is not None else None

    def piece(text: str, reasoning: str = "", calls: list[ToolCall] | None = None) -> dict[str, Any]:
        head: dict[str, Any] = {"model": run.model, "created_at": _now()}
        if chat:
            head["message"] = {"role": "assistant", "content": text}
            if reasoning:
                head["message"]["thinking"] = reasoning
            if calls:
                head["message"]["tool_calls"] = _calls(calls)
        else:
            head["response"] = text
            if reasoning:
                head["thinking"] = reasoning
        return head

    def logprobs(entries: Any) -> dict[str, Any]:
        return {"logprobs": chat_logprobs(list(entries))["content"]} if run.req.top_logprobs is not None else {}

    if not stream:
        text, _ = await run.collect(run.request)
        if parser is None:
            return JSONResponse({**piece(text), **_final_fields(run), **logprobs(run.logprobs)}, headers=run.headers)
        reply = parser.parse(text, tuple(run.tool_calls))
        return JSONResponse({**piece(reply.content, reply.reasoning, reply.tool_calls), **_final_fields(run),
                             **logprobs(run.logprobs)}, headers=run.headers)

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for ev in run:
                if isinstance(ev, KeepAlive):  # a long prompt: a line every 10 s until the first token
                    # (Cline gives up on a stream that has not started within 30 s)
                    yield _ndjson({**piece(""), "done": False})
                elif isinstance(ev, TokenEvent):
                    if parser is None:
                        yield _ndjson({**piece(ev.text), "done": False, **logprobs(ev.logprobs)})
                        continue
                    d = parser.feed(ev.text, ev.tool_calls)
                    if d.content or d.reasoning or ev.logprobs:
                        yield _ndjson({**piece(d.content, d.reasoning), "done": False, **logprobs(ev.logprobs)})
        except LlmdError as e:  # after the first token the status is sent: report in the stream
            yield _ndjson({"error": e.message})
            return
        if parser is not None:
            d = parser.finish()
            if d.content or d.reasoning or d.tool_calls:
                yield _ndjson({**piece(d.content, d.reasoning, d.tool_calls), "done": False})
        yield _ndjson({**piece(""), **_final_fields(run)})

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers=run.headers)


def _keep_alive(request: Request, body: _Base) -> None:
    if body.keep_alive is not None:
        request.app.state.registry.get(body.model)
        request.app.state.scheduler.set_keep_alive(body.model, body.keep_alive)


async def chat(request: Request) -> Response:
    body = await parse_body(request, ChatBody)
    body.model = canonical_name(request.app.state.registry, body.model)
    _keep_alive(request, body)
    if any(m.images for m in body.messages):
        raise BadRequest("messages carry images; the loaded models are text-only", "messages.images")
    if not body.messages:  # Ollama loads the model and answers done
        return await _load_only(request, body, chat=True)
    fmt = await chat_format(request, body.model)
    if body.think and not fmt.thinking:
        note_no_thinking(request, body.model, ["think"])
    # a chat longer than the context loses its oldest messages, as Ollama's does (said in a header)
    req = _generation(body, messages=_messages(body), tools=normalize_tools(body.tools), drop_old_messages=True)
    run = await start_run(request, body.model, req, "ollama", stream=body.stream)
    return await _respond(run, body.stream, chat=True)


async def generate(request: Request) -> Response:
    body = await parse_body(request, GenerateBody)
    body.model = canonical_name(request.app.state.registry, body.model)
    _keep_alive(request, body)
    if body.images:
        raise BadRequest("the request carries images; the loaded models are text-only", "images")
    if not body.prompt and not body.system and not body.suffix:
        return await _load_only(request, body, chat=False)
    if body.suffix:  # as Ollama: a suffix makes the prompt the code before the cursor
        req = _generation(body, fim=FimPrompt(prefix=body.prompt, suffix=body.suffix,
                                              n_indent=cursor_indent(body.prompt)))
    elif body.raw:
        req = _generation(body, prompt=body.prompt, raw=True)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        req = _generation(body, messages=messages)
    run = await start_run(request, body.model, req, "ollama", stream=body.stream)
    return await _respond(run, body.stream, chat=False)


async def _load_only(request: Request, body: _Base, chat: bool) -> Response:
    """Ollama's empty request: load the model (or, with keep_alive 0, unload it)."""
    scheduler = request.app.state.scheduler
    if body.keep_alive is not None and scheduler.keep_alive_for(body.model) == 0:
        scheduler.unload(body.model)
        out: dict[str, Any] = {"model": body.model, "created_at": _now(), "done": True, "done_reason": "unload"}
    else:
        _, load_s = await scheduler.worker_for(body.model)
        out = {"model": body.model, "created_at": _now(), "done": True, "done_reason": "load",
               "load_duration": int(load_s * 1e9)}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return JSONResponse(out)


def _details(m: dict[str, Any]) -> dict[str, Any]:
    n = m.get("n_params") or 0
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    return {"parent_model": "", "format": m["format"], "family": m["arch"], "families": [m["arch"]],
            "parameter_size": size, "quantization_level": m["quantization"]}


def _modified(m: dict[str, Any]) -> str:
    return datetime.fromtimestamp(m["mtime"], timezone.utc).isoformat().replace("+00:00", "Z")


def _tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


async def tags(request: Request) -> Response:
    # Ollama lists tagged names; an untagged model is `name:latest` (and answers to both)
    models = [{"name": _tagged(m["name"]), "model": _tagged(m["name"]), "modified_at": _modified(m), "size": m["size"],
               "digest": m["digest"].removeprefix("sha256:"), "details": _details(m)}
              for m in request.app.state.registry.list()]
    return JSONResponse({"models": models})


def _vram(info: dict[str, Any], size: int) -> int:
    """The share of a loaded model in GPU memory: all of it on TensorRT-LLM, the offloaded layers'
    share on llama.cpp (their weights and KV cache), none on the CPU."""
    if info.get("engine") == "tensorrt":
        return int(size)
    layers, n_layer = int(info.get("gpu_layers") or 0), int(info.get("n_layer") or 0)
    return int(size * layers / n_layer) if layers and n_layer else 0


async def ps(request: Request) -> Response:
    scheduler = request.app.state.scheduler
    registry = request.app.state.registry
    out = []
    for name, w in list(scheduler.workers.items()):
        m = registry.get(name)
        exp = scheduler.expires_at(name)
        expires = (datetime.fromtimestamp(exp, timezone.utc).isoformat().replace("+00:00", "Z")
                   if exp is not None else "2318-08-30T00:00:00Z")
        size = w.info.get("memory_estimate", {}).get("total", m["size"])
        out.append({"name": _tagged(name), "model": _tagged(name), "size": size,
                    "digest": m["digest"].removeprefix("sha256:"), "details": _details(m), "expires_at": expires,
                    "size_vram": _vram(w.info, size), "context_length": w.cfg.n_ctx})
    return JSONResponse({"models": out})


def capabilities(info: Any, fills_middle: bool = False) -> list[str]:
    """What Ollama's /api/show says a model can do: an embedding model embeds; a chat model
    completes, calls tools when its template renders them, thinks when it writes <think>, and
    fills in the middle ("insert", as Ollama says) when its vocabulary has FIM tokens."""
    if info is None:  # a TensorRT folder or a remote model: it chats
        return ["completion"]
    if info.embedding_only:
        return ["embedding"]
    fmt = detect(info.chat_template)
    return (["completion"] + (["tools"] if fmt.native_tools else []) + (["insert"] if fills_middle else [])
            + (["thinking"] if fmt.thinking else []))


def _context_of(request: Request, name: str, info: Any) -> int:
    """The context per slot a request to this model can get: the loaded one or what it grows to when
    a prompt needs it (memory.starting_ctx), else what a load would choose. Continue sizes its
    prompts by this."""
    worker = request.app.state.scheduler.workers.get(name)
    if worker is not None and worker.cfg is not None:
        return int(max(worker.cfg.n_ctx, worker.cfg.ctx_ceiling))
    s = request.app.state.settings
    if info is None:
        return 0
    ctx = load_ctx(info, s.slots, fixed_ctx(s.ctx), s.ctx_start)
    return max(ctx.n_ctx, ctx.ceiling)


async def show(request: Request) -> Response:
    body = await parse_body(request, ShowBody)
    name = body.model or body.name
    if not name:
        raise BadRequest("send the model's name in 'model'", "model")
    m = request.app.state.registry.get(canonical_name(request.app.state.registry, name))
    from llmd.models.gguf import read_gguf

    info = await asyncio.to_thread(read_gguf, m["path"]) if m["format"] == "gguf" else None
    fim = await asyncio.to_thread(fim_spellings, m)
    meta = info.metadata if info else {"general.architecture": m["arch"]}
    model_info = {k: v for k, v in meta.items() if not isinstance(v, list) and k != "tokenizer.chat_template"}
    model_info["general.parameter_count"] = m["n_params"]
    model_info.setdefault("general.basename", m["name"].split(":")[0].rsplit("/", 1)[-1])
    if info is not None and info.context_length:  # what VS Code's and Continue's providers read
        model_info.setdefault(f"{info.arch}.context_length", info.context_length)
    template = (info.chat_template if info else None) or ""
    ctx = _context_of(request, m["name"], info)
    return JSONResponse({
        "modelfile": f"FROM {m['path']}\n",
        "parameters": f"num_ctx {ctx}" if ctx else "",  # Continue reads num_ctx from this text
        # editors turn fill-in-the-middle on when the template holds {{ .Suffix }}: only FIM models show it
        "template": ollama_template(fim, template) if len(fim) == 3 else template,
        "details": _details(m),
        "model_info": model_info,
        "capabilities": capabilities(info, len(fim) == 3),
        "modified_at": _modified(m),
    })


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_COMPAT_VERSION, "llmd_version": __version__})


routes = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/version", version, methods=["GET"]),
]
