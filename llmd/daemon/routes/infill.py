"""llama-server's POST /infill, as llama.vscode and llama.vim call it: fill in the middle.

`input_prefix` + `prompt` (the cursor line before the cursor) is the code before the cursor,
`input_suffix` the code after it, `input_extra` chunks of other files shown first. The same
engine path as Ollama's and OpenAI's `suffix` (GenerationRequest.fim). The reply ends where an
editor shows it: at the model's end, at `n_predict`, at a line indented less than `n_indent`, or
after `t_max_predict_ms` once a line is complete (the engine stops there: chat.fim.Cut). Streams are
llama-server's SSE (`data: {...}` with `content` and `stop`); the last object carries the timings
llama.vscode reads.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmd.backends.base import FimPrompt, GenerationRequest, Sampling, TokenEvent, Usage
from llmd.daemon.routes._common import KeepAlive, parse_body, start_run
from llmd.daemon.security import error_body
from llmd.errors import LlmdError


class _Chunk(BaseModel):
    model_config = ConfigDict(extra="allow")
    filename: str = "tmp"
    text: str = ""


class InfillBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    prompt: str = ""  # the cursor's line before the cursor, after input_prefix
    input_extra: list[_Chunk] = Field(default_factory=list, max_length=1024)
    n_predict: int = Field(default=-1, ge=-1)
    n_indent: int = Field(default=0, ge=0)
    t_max_prompt_ms: int | None = None  # accepted: a prompt is never cut short (it would change the answer)
    t_max_predict_ms: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=64)
    stream: bool = False
    cache_prompt: bool = True


def _timings(u: Usage | None) -> dict[str, Any]:
    if u is None:
        return {"prompt_n": 0, "prompt_ms": 0.0, "predicted_n": 0, "predicted_ms": 0.0}
    prompt_n, predicted = u.prompt_tokens - u.cached_tokens, u.completion_tokens
    out = {"prompt_n": prompt_n, "prompt_ms": round(u.prefill_s * 1000, 3), "predicted_n": predicted,
           "predicted_ms": round(u.decode_s * 1000, 3), "cache_n": u.cached_tokens}
    out["prompt_per_second"] = round(prompt_n / u.prefill_s, 2) if u.prefill_s > 0 else 0.0
    out["predicted_per_second"] = round(predicted / u.decode_s, 2) if u.decode_s > 0 else 0.0
    return out


async def infill(request: Request) -> Response:
    body = await parse_body(request, InfillBody)
    fim = FimPrompt(prefix=body.input_prefix + body.prompt, suffix=body.input_suffix,
                    extra=tuple((c.filename, c.text) for c in body.input_extra), n_indent=body.n_indent,
                    t_max_predict_ms=body.t_max_predict_ms)
    req = GenerationRequest(
        id=uuid.uuid4().hex, fim=fim, max_tokens=body.n_predict if body.n_predict >= 0 else None,
        sampling=Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                          seed=body.seed),
        stop=tuple(body.stop), cache_prompt=body.cache_prompt)
    run = await start_run(request, body.model, req, "infill", stream=body.stream)

    def last(text: str) -> dict[str, Any]:
        u = run.final.usage if run.final else None
        return {"content": text, "stop": True, "model": run.model, "tokens_predicted": u.completion_tokens if u else 0,
                "tokens_evaluated": u.prompt_tokens if u else 0, "tokens_cached": u.cached_tokens if u else 0,
                "truncated": False, "stop_type": "limit" if run.final and run.final.finish_reason == "length" else "eos",
                "timings": _timings(u)}

    if not body.stream:
        text, _ = await run.collect(request)
        return JSONResponse(last(text), headers=run.headers)

    async def events() -> AsyncIterator[bytes]:
        try:
            async for ev in run:
                if isinstance(ev, KeepAlive):
                    yield b": keep-alive\n\n"
                elif isinstance(ev, TokenEvent) and ev.text:
                    yield _sse({"content": ev.text, "stop": False})
        except LlmdError as err:
            yield _sse({"error": error_body("/infill", err)["error"]})
            return
        yield _sse(last(""))

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **run.headers})


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


routes = [Route("/infill", infill, methods=["POST"])]
