"""A recording reverse proxy for the front-end tests: an app is pointed at it instead of llmd, and
every request it makes is passed through unchanged (streams included) and written down as
(method, path, status), so a test can say which routes the app used and that none failed. The
requests themselves can be saved as a recording that benchmarks/agents.py replays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from thread_server import ThreadServer

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class Recorder(ThreadServer):
    def __init__(self, upstream: str) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.requests: list[tuple[str, str, bytes]] = []  # (method, path, body), in order
        self.saved = 0  # requests already written by save()
        self.errors: list[str] = []  # each 4xx/5xx answer, with what it said
        self.upstream = upstream
        app = Starlette(routes=[Route("/{path:path}", self._relay,
                                      methods=["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"])])
        super().__init__(app)

    async def _relay(self, request: Request) -> Response:
        client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(900.0, connect=10.0))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        body = await request.body()
        self.requests.append((request.method, request.url.path, body))
        req = client.build_request(request.method, request.url.path, params=request.query_params,
                                   headers=headers, content=body)
        r = await client.send(req, stream=True)
        self.calls.append((request.method, request.url.path, r.status_code))
        if r.status_code >= 400:  # what llmd said, for a failing test's message (CI keeps no daemon log)
            said = (await r.aread()).decode(errors="replace")
            self.errors.append(f"{request.method} {request.url.path} {r.status_code}: {said[:600]}")
            await r.aclose()
            await client.aclose()
            return Response(said, status_code=r.status_code,
                            headers={k: v for k, v in r.headers.items() if k.lower() not in HOP})

        async def close() -> None:
            await r.aclose()
            await client.aclose()

        return StreamingResponse(r.aiter_raw(), status_code=r.status_code, background=BackgroundTask(close),
                                 headers={k: v for k, v in r.headers.items() if k.lower() not in HOP})

    def failed(self, allowed: set[tuple[str, int]] | None = None) -> list[tuple[str, str, int]]:
        """Calls answered 4xx/5xx, less those expected by design ((path, status) in `allowed`)."""
        return [c for c in self.calls if c[2] >= 400 and (c[1], c[2]) not in (allowed or set())]

    @property
    def bodies(self) -> list[bytes]:
        """Each request's body, in order."""
        return [body for _, _, body in self.requests]

    def save(self, path: Path) -> int:
        """The JSON POSTs made since the last save, one per line as benchmarks/agents.py reads them
        ({"method", "path", "body"}); how many were written."""
        rows = []
        for method, route, body in self.requests[self.saved:]:
            if method == "POST" and body[:1] == b"{":
                rows.append(json.dumps({"method": method, "path": route, "body": json.loads(body)}))
        self.saved = len(self.requests)
        if rows:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(rows) + "\n")
        return len(rows)

    def routes(self) -> list[str]:
        return sorted({f"{m} {p}" for m, p, _ in self.calls})


def summary(rec: Recorder) -> Any:
    return {"routes": rec.routes(), "failed": rec.failed(), "said": rec.errors[-3:]}
