"""Ollama's model management: /api/pull (from the Hugging Face Hub), /api/delete, /api/copy.

These change the daemon, so they follow security.authorize: llmd's token, or a connection from
a process of the user llmd runs as (so that user's Ollama clients need no setup, as with Ollama;
not when llmd runs as root, and never a browser). A pull streams NDJSON progress in Ollama's shape
(status, digest, total, completed); the download runs in a thread, so every other route keeps
answering. Deleting removes only files llmd downloaded or made, never another tool's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmd.daemon.routes._common import canonical_name, parse_body
from llmd.daemon.security import authorize
from llmd.errors import BadRequest, LlmdError, UpstreamError
from llmd.models.hub import HubFile, PullPlan, is_hub_ref, parse_ref, pull
from llmd.models.registry import MODEL_NAME

PROGRESS_EVERY_S = 0.25  # at most this often per file: a client redraws its bar, nothing more


class PullBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)  # the older field
    insecure: bool = False
    stream: bool = True


class DeleteBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)


class CopyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1, pattern=MODEL_NAME)


def _model_of(body: PullBody | DeleteBody) -> str:
    name = body.model or body.name
    if not name:
        raise BadRequest("send the model's name in 'model'", "model")
    return name


async def pull_model(request: Request) -> Response:
    """Download a GGUF model from the Hugging Face Hub (hf.co/USER/REPO[:QUANT]) and register it."""
    body = await parse_body(request, PullBody)
    name = _model_of(body)
    registry = request.app.state.registry
    if not is_hub_ref(name) and registry.has(canonical_name(registry, name)):
        # registered already: nothing changes, so no token is asked for (Codex's --oss pulls the
        # model it runs at every start, which a daemon running as root would otherwise refuse)
        return _already(body.stream)
    await authorize(request, request.app.state.token)
    if not is_hub_ref(name):
        raise BadRequest(f"llmd pulls GGUF models from the Hugging Face Hub; {name!r} is not registered and not a "
                         "Hub reference: pull hf.co/USER/REPO[:QUANT] (e.g. hf.co/bartowski/Qwen2.5-0.5B-Instruct-GGUF"
                         ":Q4_K_M)", "model")
    parse_ref(name)  # a malformed reference is a 400 before any stream starts
    models_dir = request.app.state.settings.paths.models_dir
    lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    last: dict[str, float] = {}

    def put(line: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(lines.put_nowait, line)

    def planned(p: PullPlan) -> None:
        put({"status": "pulling manifest"})
        for note in p.notes:
            put({"status": note})

    def progress(f: HubFile, done: int) -> None:
        now = time.monotonic()
        if done < f.size and now - last.get(f.name, 0.0) < PROGRESS_EVERY_S:
            return
        last[f.name] = now
        digest = f"sha256:{f.sha256}" if f.sha256 else f.name
        put({"status": f"pulling {digest.removeprefix('sha256:')[:12]}", "digest": digest, "total": f.size,
             "completed": done})

    def run() -> dict[str, Any]:
        try:
            try:
                row = pull(name, registry, models_dir, progress, on_plan=planned)
            except LlmdError:
                raise
            except Exception as e:  # whatever failed, the client gets an error it can read, never a cut stream
                raise UpstreamError(f"pulling {name} failed ({type(e).__name__}: {e}); pull again to resume") from e
            put({"status": "verifying sha256 digest"})
            put({"status": "writing manifest"})
            put({"status": "success"})
            return row
        finally:
            loop.call_soon_threadsafe(lines.put_nowait, None)

    task = asyncio.ensure_future(asyncio.to_thread(run))
    if not body.stream:
        await task  # an LlmdError becomes the API's error reply
        return JSONResponse({"status": "success"})

    async def stream() -> AsyncIterator[bytes]:
        while (line := await lines.get()) is not None:
            yield (json.dumps(line) + "\n").encode()
        try:
            await task
        except LlmdError as e:  # after the stream started, the error is its last line (as Ollama does)
            yield (json.dumps({"error": e.message}) + "\n").encode()

    return StreamingResponse(stream(), media_type="application/x-ndjson")


def _already(stream: bool) -> Response:
    if not stream:
        return JSONResponse({"status": "success"})
    lines = [{"status": "pulling manifest"}, {"status": "success"}]
    return Response("".join(json.dumps(x) + "\n" for x in lines), media_type="application/x-ndjson")


async def delete_model(request: Request) -> Response:
    """Remove a model (its file only when llmd downloaded or made it)."""
    await authorize(request, request.app.state.token)
    body = await parse_body(request, DeleteBody)
    registry = request.app.state.registry
    row = registry.get(_model_of(body))
    request.app.state.scheduler.unload(row["name"])
    await asyncio.to_thread(registry.remove, row["name"])
    return Response(status_code=200)


async def copy_model(request: Request) -> Response:
    """Register a model under a second name (the same file: nothing is copied)."""
    await authorize(request, request.app.state.token)
    body = await parse_body(request, CopyBody)
    request.app.state.registry.copy(body.source, body.destination)
    return Response(status_code=200)


routes = [
    Route("/api/pull", pull_model, methods=["POST"]),
    Route("/api/delete", delete_model, methods=["DELETE"]),
    Route("/api/copy", copy_model, methods=["POST"]),
]
