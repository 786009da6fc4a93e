"""llmd's own routes. Read-only ones (health, status, models) are open on loopback; the ones
that change the daemon (load, unload, switch, add, remove) need the bearer token or a connection
from llmd's own user, and those that read a file or a variable of this machine always the token
(security.authorize)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmd import __version__
from llmd.backends.llamacpp.prefix_store import PrefixStore
from llmd.config import SpeculationMode, fixed_ctx
from llmd.daemon.routes._common import fim_spellings, parse_body
from llmd.daemon.security import authorize
from llmd.errors import BadRequest
from llmd.models.gguf import read_gguf
from llmd.models.memory import available_bytes, estimate, load_ctx
from llmd.models.registry import MODEL_NAME, NO_DRAFT, check_pair


class PairBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    draft: str | None = None  # None: no draft model, not even one paired automatically
    auto: bool = False  # back to automatic pairing (draft must be None)


class SpeculationBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: SpeculationMode


class ModelRefBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)


class ClearCacheBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    responses: bool = True
    prefixes: bool = True


class AddModelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    name: str | None = Field(default=None, min_length=1, pattern=MODEL_NAME)


class AddRemoteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, pattern=MODEL_NAME)
    urls: list[str] = Field(min_length=1, max_length=32)
    upstream_model: str | None = Field(default=None, min_length=1)
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    api_key_file: str | None = Field(default=None, min_length=1)
    fallback: str | None = Field(default=None, min_length=1)
    insecure: bool = False


async def _authorize(request: Request) -> None:
    await authorize(request, request.app.state.token)


async def health(request: Request) -> Response:
    scheduler = request.app.state.scheduler
    return JSONResponse({"status": "ok", "version": __version__, "pid": os.getpid(),
                         "loaded": sorted(scheduler.workers)})


async def status(request: Request) -> Response:
    app = request.app
    s = app.state.settings
    scheduler = app.state.scheduler
    choice = scheduler.choice_for(scheduler.active_model)
    body = {
        "version": __version__,
        "pid": os.getpid(),
        "uptime_s": round(time.time() - app.state.started, 1),
        "address": s.base_url,
        "backend": {"name": choice.backend, "precision": choice.precision, "reason": choice.reason,
                    "gpu_layers": choice.gpu_layers, "gpu": choice.gpu, "overridden": choice.overridden,
                    "rejected": [{"option": o, "why": w} for o, w in choice.rejected]},
        "machine": scheduler.probe.as_dict() if scheduler.probe else None,
        "memory_available": available_bytes(),
        "dropped_messages": dict(app.state.metrics.dropped_by_model),  # by model, to fit (Ollama's API)
        "fim_proposals": dict(app.state.suggestions.stats),  # editors' completions (daemon.suggestions)
        "fim_reply_within_s": app.state.suggestions.reply_times(),  # by model: answered with what it has by then
        "apps": app.state.apps_seen.summary(),  # who used which model, the last 10 minutes (daemon.apps_seen)
        **await app.state.scheduler.status(),
    }
    return JSONResponse(body)


def _describe(request: Request, row: dict[str, Any]) -> dict[str, Any]:
    s = request.app.state.settings
    scheduler = request.app.state.scheduler
    out = {**row, "gguf": None, "memory_estimate": None,
           "loaded": row["name"] in scheduler.workers, "active": row["name"] == scheduler.active_model}
    if row["format"] == "gguf":
        info = read_gguf(row["path"])
        ctx = load_ctx(info, s.slots, fixed_ctx(s.ctx), s.ctx_start)
        out.update(gguf=info.summary(), memory_estimate=estimate(info, ctx.n_ctx, s.slots).as_dict(),
                   ctx_reason=ctx.reason)
    out["fill_in_the_middle"] = len(fim_spellings(row)) == 3  # /infill, and `suffix` on Ollama's and OpenAI's
    return out


async def list_models(request: Request) -> Response:
    scheduler = request.app.state.scheduler
    return JSONResponse({"models": [{**m, "loaded": m["name"] in scheduler.workers,
                                     "active": m["name"] == scheduler.active_model}
                                    for m in request.app.state.registry.list()]})


async def show_model(request: Request) -> Response:
    return JSONResponse(_describe(request, request.app.state.registry.get(request.path_params["name"])))


async def add_model(request: Request) -> Response:
    await authorize(request, request.app.state.token, reads_local_files=True)  # a path on this machine
    body = await parse_body(request, AddModelBody)
    # hashing a multi-GB file takes seconds: off the event loop, so every other route keeps answering
    row = await asyncio.to_thread(request.app.state.registry.add, Path(body.path), body.name)
    return JSONResponse(_describe(request, row), status_code=201)


async def add_remote_model(request: Request) -> Response:
    """Register a model served by upstream engines (asked what they are before it is written)."""
    from llmd.backends.remote.spec import build

    body = await parse_body(request, AddRemoteBody)
    # an API key read from a file or a variable here is sent to the URLs given: the token, always
    await authorize(request, request.app.state.token, reads_local_files=bool(body.api_key_env or body.api_key_file))
    registry = request.app.state.registry
    registry.check_free(body.name)
    spec = await asyncio.to_thread(build, body.urls, body.upstream_model, body.api_key_env, body.api_key_file,
                                   body.fallback, body.insecure, registry)
    row = registry.add_remote(body.name, spec.to_json(), spec.kind)
    return JSONResponse(_describe(request, row), status_code=201)


async def remove_model(request: Request) -> Response:
    await _authorize(request)
    name = request.path_params["name"]
    registry = request.app.state.registry
    registry.get(name)
    request.app.state.scheduler.unload(name)
    row = registry.remove(name)
    return JSONResponse({"removed": name, "deleted_file": row["deleted_file"]})


async def load_model(request: Request) -> Response:
    await _authorize(request)
    body = await parse_body(request, ModelRefBody)
    worker, load_s = await request.app.state.scheduler.worker_for(body.model, explicit=True)
    return JSONResponse({"model": body.model, "pid": worker.pid, "load_s": round(load_s, 3)})


async def unload_model(request: Request) -> Response:
    await _authorize(request)
    body = await parse_body(request, ModelRefBody)
    request.app.state.registry.get(body.model)
    was_loaded = request.app.state.scheduler.unload(body.model)
    return JSONResponse({"model": body.model, "unloading": was_loaded})


async def set_active(request: Request) -> Response:
    await _authorize(request)
    body = await parse_body(request, ModelRefBody)
    t0 = time.perf_counter()
    worker = await request.app.state.scheduler.set_active(body.model)
    return JSONResponse({"active_model": body.model, "pid": worker.pid,
                         "switch_s": round(time.perf_counter() - t0, 3)})


async def pair_model(request: Request) -> Response:
    """Pair (or unpair) a draft model. A loaded target is unloaded, so that its next load, on the
    next request, brings the draft in; streams in flight finish first."""
    await _authorize(request)
    body = await parse_body(request, PairBody)
    registry = request.app.state.registry
    if body.auto and body.draft is not None:
        raise BadRequest("give a draft model or auto, not both", "auto")
    if body.draft is not None:  # reading two vocabularies takes a moment: not on the event loop
        await asyncio.to_thread(check_pair, registry.get(body.model), registry.get(body.draft))
    row = registry.pair(body.model, None if body.auto else body.draft or NO_DRAFT, checked=True)
    reloading = request.app.state.scheduler.unload(row["name"])
    request.app.state.scheduler.touch()
    return JSONResponse({"model": row["name"], "draft": row["draft"] or None, "auto": row["draft"] is None,
                         "reloads": reloading})


async def set_speculation(request: Request) -> Response:
    """The speculation mode for requests that name none (the tray's Speculation menu)."""
    await _authorize(request)
    body = await parse_body(request, SpeculationBody)
    scheduler = request.app.state.scheduler
    scheduler.speculation = body.mode
    scheduler.touch()
    return JSONResponse({"speculation": body.mode})


def _prefix_store(request: Request) -> PrefixStore:
    s = request.app.state.settings
    return PrefixStore(s.paths.prefix_dir, s.prefix_cache_mb * 1024 * 1024)


async def cache_stats(request: Request) -> Response:
    rc = request.app.state.response_cache
    engines = {m["name"]: (m.get("stats") or {}).get("prefix_cache")
               for m in (await request.app.state.scheduler.status())["loaded"]}
    store = await asyncio.to_thread(lambda: _prefix_store(request).stats())  # SQLite off the event loop
    return JSONResponse({
        "responses": await asyncio.to_thread(rc.stats) if rc is not None else {"enabled": False},
        "prefixes": {**store, "engines": engines},
    })


async def cache_clear(request: Request) -> Response:
    await _authorize(request)
    body = await parse_body(request, ClearCacheBody) if await request.body() else ClearCacheBody()
    rc = request.app.state.response_cache
    out: dict[str, Any] = {}
    if body.responses and rc is not None:
        out["responses_cleared"] = await asyncio.to_thread(rc.clear)  # file work off the event loop
    if body.prefixes:
        # each running engine clears its own entries (between its steps: no file goes away under a
        # read of its own); the daemon then removes those of models no worker serves now
        cleared, keep, silent = 0, set(), []
        for name, handle in list(request.app.state.scheduler.workers.items()):
            got = await handle.clear_caches()
            if not got and not handle.remote:
                silent.append(name)
            cleared += int(got.get("prefixes_cleared", 0))
            if got.get("namespace"):
                keep.add(got["namespace"])
        if silent:  # its namespace is unknown: the rest stays rather than be removed under it
            out["prefixes_note"] = (f"{', '.join(silent)} did not answer; the prefix entries of models not "
                                    "loaded were kept: clear again when it is idle")
        else:
            cleared += await asyncio.to_thread(lambda: _prefix_store(request).clear(None, keep))
        out["prefixes_cleared"] = cleared
    return JSONResponse(out)


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    m = request.app.state.metrics
    m.set_snapshot(await request.app.state.scheduler.status())
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)


async def history(request: Request) -> Response:
    return JSONResponse({"points": list(request.app.state.metrics.history)})


async def dashboard(request: Request) -> Response:
    from importlib.resources import files

    page = files("llmd.daemon").joinpath("static/dashboard.html").read_bytes()
    return Response(page, media_type="text/html; charset=utf-8")


async def tray_state(request: Request) -> dict[str, Any]:
    """The compact state a tray or a watcher shows: what changed is pushed by /llmd/events."""
    app = request.app
    scheduler = app.state.scheduler
    points = [p for p in app.state.metrics.history if p.get("ttft_p50") is not None]
    last = points[-1] if points else {}
    rc = app.state.response_cache
    # running counters only: no table scan, no lock a writer thread holds (each subscriber asks)
    rs = {"hits": rc.hits, "misses": rc.misses} if rc is not None else {}
    lookups = rs.get("hits", 0) + rs.get("misses", 0)
    choice = scheduler.choices.get(scheduler.active_model)
    return {
        "active_model": scheduler.active_model,
        "speculation": scheduler.speculation,
        "models": app.state.registry.names(),
        "loaded": sorted(scheduler.workers),
        "resident": {name: scheduler.why_resident(name, short=True) for name in sorted(scheduler.workers)},
        "loading": scheduler.loading,
        "requests_in_flight": scheduler.in_flight,
        "backend": {"name": choice.backend, "precision": choice.precision} if choice else None,
        "ttft_p50_ms": round(last["ttft_p50"] * 1000, 1) if last else None,
        "tokens_per_s": round(last["tokens_per_s"], 1) if last.get("tokens_per_s") else None,
        "cache_hit_rate": round(rs.get("hits", 0) / lookups, 3) if lookups else None,
        "worker_crashes": scheduler.crashes,
        "version": scheduler.version,
        # which apps used which model lately, the most engine time first (the tray's Apps lines)
        "apps": [{"app": a["app"], "model": a["model"], "requests": a["requests"]}
                 for a in app.state.apps_seen.summary()[:5]],
    }


async def events(request: Request) -> Response:
    """Server-sent events: the tray state now, then again on every change (heartbeat every 15 s)."""
    from starlette.responses import StreamingResponse

    scheduler = request.app.state.scheduler

    async def stream() -> Any:
        import json

        seen = -1
        while True:
            if await request.is_disconnected():
                return
            state = await tray_state(request)
            seen = state["version"]
            yield b"event: state\ndata: " + json.dumps(state).encode() + b"\n\n"
            await scheduler.wait_change(seen, 15.0)

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


routes = [
    Route("/llmd/events", events, methods=["GET"]),
    Route("/", dashboard, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/llmd/history", history, methods=["GET"]),
    Route("/llmd/cache", cache_stats, methods=["GET"]),
    Route("/llmd/cache/clear", cache_clear, methods=["POST"]),
    Route("/llmd/health", health, methods=["GET"]),
    Route("/llmd/status", status, methods=["GET"]),
    Route("/llmd/models", list_models, methods=["GET"]),
    Route("/llmd/models", add_model, methods=["POST"]),
    Route("/llmd/models/remote", add_remote_model, methods=["POST"]),
    Route("/llmd/models/load", load_model, methods=["POST"]),
    Route("/llmd/models/unload", unload_model, methods=["POST"]),
    Route("/llmd/models/active", set_active, methods=["POST"]),
    Route("/llmd/models/pair", pair_model, methods=["POST"]),
    Route("/llmd/speculation", set_speculation, methods=["POST"]),
    Route("/llmd/models/{name:path}", show_model, methods=["GET"]),
    Route("/llmd/models/{name:path}", remove_model, methods=["DELETE"]),
]
