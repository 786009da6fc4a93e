"""Embedding routes: OpenAI's /v1/embeddings, Ollama's /api/embed and its older /api/embeddings.

Each input is looked up in the response cache on its own (keyed by the model's digest, the input
and the truncation asked for), so a batch computes only what it has not seen; the rest goes to
the model's worker as one EmbedRequest.
"""

from __future__ import annotations

import array
import asyncio
import base64
import hashlib
import json
import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmd.backends.base import EmbedRequest, Usage
from llmd.daemon.apps_seen import app_name
from llmd.daemon.routes._common import canonical_name, parse_body
from llmd.errors import BadRequest
from llmd.priority import classify_embedding

_log = logging.getLogger("llmd.requests")

MAX_INPUTS = 2048  # as OpenAI's limit per request
BATCH = 16  # inputs per worker command: the engine embeds them between generation steps


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted and ignored, as everywhere in llmd


class OllamaBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[str] = ""
    truncate: bool = True  # Ollama's default
    dimensions: int | None = Field(default=None, ge=1)
    keep_alive: float | int | str | None = None
    options: dict[str, Any] | None = None


class LegacyBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    prompt: str = ""
    keep_alive: float | int | str | None = None
    options: dict[str, Any] | None = None


def _key(digest: str, item: str | tuple[int, ...], truncate: bool) -> str:
    blob = json.dumps({"v": 1, "kind": "embedding", "model_digest": digest, "input": item, "truncate": truncate},
                      ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


async def embed(request: Request, model: str | None, inputs: list[str | tuple[int, ...]], truncate: bool,
                dimensions: int | None) -> tuple[str, list[bytes], int, str]:
    """(model, float32 vectors, prompt tokens, cache status) for the inputs, in order."""
    cls, why = classify_embedding(request.headers, getattr(request.state, "priority_asked", ""))
    if not inputs:
        raise BadRequest("input is empty; send a string or a list of strings", "input")
    if len(inputs) > MAX_INPUTS:
        raise BadRequest(f"input has {len(inputs)} items; send at most {MAX_INPUTS} per request", "input")
    state = request.app.state
    name = canonical_name(state.registry, model or state.scheduler.active_model)
    row = state.registry.get(name)
    cache = state.response_cache
    no_store = "no-store" in request.headers.get("cache-control", "").lower()
    keys = [_key(row["digest"], item, truncate) for item in inputs]
    found: dict[int, tuple[bytes, int]] = {}
    if cache is not None and not no_store:
        hits = await asyncio.to_thread(lambda: [cache.get(k) for k in keys])
        found = {i: (base64.b64decode(h.pieces[0]), h.usage.prompt_tokens) for i, h in enumerate(hits) if h}
    todo = [i for i in range(len(inputs)) if i not in found]
    fresh: dict[int, tuple[bytes, int]] = {}
    t0 = time.perf_counter()
    for at in range(0, len(todo), BATCH):  # in batches: generation runs between them, and the heartbeat
        part = todo[at:at + BATCH]
        result = await state.scheduler.embed(name, EmbedRequest(uuid.uuid4().hex, tuple(inputs[i] for i in part),
                                                                truncate, cls))
        fresh.update(zip(part, zip(result.vectors, result.tokens, strict=True), strict=True))
    if todo:  # the engine's time, seen per app (apps_seen) and in the request log as generations are
        took = time.perf_counter() - t0
        app = app_name(request.headers, state.token)
        read = sum(n for _, n in fresh.values())
        state.apps_seen.record(app, name, took, read, priority=cls)
        _log.info("request", extra={"model": name, "api": "embeddings", "outcome": "ok", "app": app,
                                    "priority": cls, "priority_reason": why, "inputs": len(inputs),
                                    "computed": len(todo), "prompt_tokens": read, "duration_s": took})
    if fresh:
        if cache is not None and not no_store:
            def store() -> None:
                for i, (vec, n) in fresh.items():
                    cache.put(keys[i], name, [base64.b64encode(vec).decode()], "embedding", Usage(n, 0, 0, 0, 0, 0))
            asyncio.get_running_loop().run_in_executor(None, store)
        found.update(fresh)
    vectors = [found[i][0] for i in range(len(inputs))]
    width = len(vectors[0]) // 4
    if dimensions is not None and dimensions != width:
        raise BadRequest(f"{name} gives {width}-wide embeddings and cannot shorten them; leave dimensions out "
                         f"(or send {width})", "dimensions")
    status = "hit" if not todo else "miss" if len(todo) == len(inputs) else "partial"
    return name, vectors, sum(found[i][1] for i in range(len(inputs))), status


def _floats(vec: bytes) -> list[float]:
    return array.array("f", vec).tolist()


async def openai_embeddings(request: Request) -> Response:
    body = await parse_body(request, OpenAIBody, nulls_are_unset=True)
    raw = body.input
    inputs: list[str | tuple[int, ...]]
    if isinstance(raw, str):
        inputs = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        inputs = [tuple(raw)]  # type: ignore[arg-type]
    else:
        inputs = [tuple(x) if isinstance(x, list) else x for x in raw]  # type: ignore[misc]
    if any(isinstance(x, str) and not x for x in inputs):
        raise BadRequest("input contains an empty string; OpenAI refuses those too", "input")
    name, vectors, tokens, status = await embed(request, body.model, inputs, False, body.dimensions)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v).decode() if body.encoding_format == "base64" else _floats(v)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                        headers={"X-LLMD-Cache": status})


async def ollama_embed(request: Request) -> Response:
    t0 = time.perf_counter()
    body = await parse_body(request, OllamaBody)
    inputs: list[str | tuple[int, ...]] = [body.input] if isinstance(body.input, str) else list(body.input)
    name, vectors, tokens, status = await embed(request, body.model, inputs, body.truncate, body.dimensions)
    return JSONResponse({"model": name, "embeddings": [_floats(v) for v in vectors],
                         "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
                         "prompt_eval_count": tokens}, headers={"X-LLMD-Cache": status})


async def ollama_embeddings(request: Request) -> Response:
    body = await parse_body(request, LegacyBody)
    if not body.prompt:  # Ollama answers an empty prompt with an empty vector
        return JSONResponse({"embedding": []})
    _, vectors, _, status = await embed(request, body.model, [body.prompt], True, None)
    return JSONResponse({"embedding": _floats(vectors[0])}, headers={"X-LLMD-Cache": status})


routes = [
    Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
    Route("/api/embed", ollama_embed, methods=["POST"]),
    Route("/api/embeddings", ollama_embeddings, methods=["POST"]),
]
