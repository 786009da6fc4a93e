"""Requests cut by the daemon's stop answer 503, not 500 (pure ASGI middleware).

On SIGTERM uvicorn stops accepting, lets running requests finish for its graceful window
(server.py: timeout_graceful_shutdown), then cancels the ones left. A cancelled request that had
not started its answer got Starlette's plain-text "Internal Server Error" (500: a crash, as far as
the client knows) while llmd was only stopping. Here it gets the server's state instead: 503 in
the API's own error shape, with Retry-After, which clients retry. A stream already under way just
ends (its client sees no [DONE]).
"""

from __future__ import annotations

import asyncio
from typing import Any

from llmd.daemon.security import send_error
from llmd.errors import ModelUnavailable

RETRY_AFTER_S = 5  # a restart (systemd, launchd, `llmd restart`) takes about this long


class StoppingMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not started:  # uvicorn cancels a request only when the server stops
                err = ModelUnavailable("llmd is shutting down (stopped or restarting) and this request was cut; "
                                       f"retry it in {RETRY_AFTER_S} s, when llmd is back")
                await send_error(scope, send, err, [(b"retry-after", str(RETRY_AFTER_S).encode())])
            raise
