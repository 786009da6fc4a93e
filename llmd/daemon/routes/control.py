"""llmd's own routes: health and status (read-only, open on loopback)."""

from __future__ import annotations

import os
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmd import __version__


async def health(request: Request) -> Response:
    scheduler = request.app.state.scheduler
    return JSONResponse({"status": "ok", "version": __version__, "pid": os.getpid(),
                         "loaded": sorted(scheduler.workers)})


async def status(request: Request) -> Response:
    app = request.app
    s = app.state.settings
    body = {
        "version": __version__,
        "pid": os.getpid(),
        "uptime_s": round(time.time() - app.state.started, 1),
        "address": s.base_url,
        "backend": {"name": "llama.cpp", "precision": "gguf",
                    "reason": "llama.cpp (GGUF) is the only engine this build enables; automatic choice comes later"},
        **await app.state.scheduler.status(),
    }
    return JSONResponse(body)


routes = [
    Route("/llmd/health", health, methods=["GET"]),
    Route("/llmd/status", status, methods=["GET"]),
]
