"""Generation requests count in the batching hint from their arrival, and always leave it."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from llmd.daemon.arrivals import ArrivalMiddleware, admission_of


def app_with(scheduler: SimpleNamespace) -> Starlette:
    async def chat(request: Request) -> JSONResponse:
        seen = scheduler.preparing  # before the body is even read
        body = await request.json()
        admission = admission_of(request.scope, scheduler)  # as _common._start takes it
        if body.get("bad"):
            return JSONResponse({"error": "bad"}, status_code=400)
        if body.get("slow_load"):
            # a stream that starts before its model has loaded: the route lets go of the request
            # with the count still on, and submission takes it out later, once
            admission.leave(scheduler)  # submission (Scheduler.generate)
            admission.leave(scheduler)  # and again, as the route's end or the middleware would
            return JSONResponse({"seen": seen, "after": scheduler.preparing})
        admission.leave(scheduler)  # submission takes it out
        return JSONResponse({"seen": seen})

    async def other(request: Request) -> JSONResponse:
        return JSONResponse({"seen": scheduler.preparing})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/api/embed", other, methods=["POST"])],
                    middleware=[Middleware(ArrivalMiddleware)])
    app.state.scheduler = scheduler
    return app


def test_counted_from_arrival_and_released_on_every_path():
    scheduler = SimpleNamespace(preparing=0)
    with TestClient(app_with(scheduler)) as c:
        assert c.post("/v1/chat/completions", json={}).json() == {"seen": 1}
        assert scheduler.preparing == 0  # taken over by the route, then out at submission: not released twice
        assert c.post("/v1/chat/completions", json={"bad": True}).status_code == 400
        assert scheduler.preparing == 0  # never submitted: released at the end
        assert c.post("/api/embed", json={}).json() == {"seen": 0}  # not a generation: not counted
        for _ in range(3):
            assert c.post("/v1/chat/completions", json={"slow_load": True}).json() == {"seen": 1, "after": 0}
        assert scheduler.preparing == 0  # never below zero: each request leaves the count once
