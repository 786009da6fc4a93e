"""create_app(settings): every route in one list, pure-ASGI middleware, and a lifespan that
owns the registry and the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmd.backends.select import probe
from llmd.config import Settings
from llmd.daemon.apps_seen import AppsSeen
from llmd.daemon.arrivals import ArrivalMiddleware
from llmd.daemon.metrics import Metrics
from llmd.daemon.response_cache import ResponseCache
from llmd.daemon.routes import (
    anthropic,
    control,
    embeddings,
    infill,
    ollama,
    ollama_models,
    openai,
    responses,
)
from llmd.daemon.scheduler import Scheduler
from llmd.daemon.security import SecurityMiddleware, error_body, load_or_create_key, load_or_create_token
from llmd.daemon.stopping import StoppingMiddleware
from llmd.daemon.stored_responses import StoredResponses
from llmd.daemon.suggestions import Suggestions
from llmd.errors import LlmdError, Overloaded
from llmd.models.registry import Registry

log = logging.getLogger("llmd.app")


async def _llmd_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LlmdError)
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
    return JSONResponse(error_body(request.url.path, exc), status_code=exc.status, headers=headers)


async def _not_found(request: Request, exc: Exception) -> Response:
    from llmd.errors import RouteNotFound

    err = RouteNotFound(f"no route {request.method} {request.url.path}; llmd serves /v1 (OpenAI), /api (Ollama) "
                        "and /llmd (its own); see README")
    return JSONResponse(error_body(request.url.path, err), status_code=404)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    from llmd.errors import RouteNotFound

    err = RouteNotFound(f"{request.url.path} does not take {request.method}")
    return JSONResponse(error_body(request.url.path, err), status_code=405)


def create_app(settings: Settings, scheduler: Scheduler | None = None) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        settings.paths.ensure()
        registry = Registry(settings.paths.registry_db, settings.paths.models_dir)
        registry.sync_packaged()
        app.state.token = load_or_create_token(settings.paths.config)
        load_or_create_key(settings.paths.prefix_key)  # before any worker reads or writes a prefix entry
        app.state.response_cache = (
            ResponseCache(settings.paths.response_cache_db, settings.response_cache_ttl,
                          settings.response_cache_mb * 1024 * 1024)
            if settings.response_cache else None)
        app.state.suggestions = Suggestions()  # the last FIM proposal at each cursor
        app.state.apps_seen = AppsSeen()  # which apps use which models (status)
        app.state.stored_responses = StoredResponses(settings.paths.responses_api_db,
                                                    settings.responses_store_mb * 2**20)
        sched = scheduler or Scheduler(settings, registry)
        app.state.suggestions.on_priority = sched.reprioritize  # a dropped one runs on as background work
        app.state.settings = settings
        app.state.registry = registry
        app.state.scheduler = sched
        app.state.started = time.time()
        sched.probe = await asyncio.to_thread(probe)
        if settings.prefix_cache_mb > 0:  # before any worker writes: what a crash left behind goes
            from llmd.backends.llamacpp.prefix_store import PrefixStore

            await asyncio.to_thread(PrefixStore, settings.paths.prefix_dir, settings.prefix_cache_mb * 1024 * 1024,
                                    sweep=True)
        app.state.metrics = Metrics(is_model=registry.has)
        sampler = asyncio.ensure_future(app.state.metrics.run_sampler(sched.status))
        preload = None
        if settings.preload:
            preload = asyncio.ensure_future(sched.worker_for(settings.model))
            preload.add_done_callback(_log_preload)
        try:
            yield {}
        finally:
            sampler.cancel()
            if preload is not None:
                preload.cancel()
            await sched.close()

    from llmd.daemon import openapi

    routes = [*openai.routes, *ollama.routes, *ollama_models.routes, *embeddings.routes, *responses.routes,
              *anthropic.routes, *infill.routes, *control.routes, *openapi.routes]
    return Starlette(
        routes=routes,
        middleware=[Middleware(StoppingMiddleware), Middleware(SecurityMiddleware, settings=settings),
                    Middleware(ArrivalMiddleware)],
        exception_handlers={LlmdError: _llmd_error, 404: _not_found, 405: _not_allowed},
        lifespan=lifespan,
    )


def _log_preload(task: asyncio.Future[Any]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("could not preload the default model: %s", exc)
