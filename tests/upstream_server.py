"""A small OpenAI-compatible stand-in upstream for the remote-model tests that need an upstream to
misbehave (malformed events, a 500) or to show what llmd sent it (the Authorization header).
Healthy replies are a fixed text streamed word by word."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REPLY = "The lighthouse keeper lit the lamp at dusk."


@dataclass
class FakeUpstream:
    # ok | malformed | error500 | truncated | stall | slow_start (8 s before its first chunk: a long
    # prefill) | tools (vLLM's shape) | badcall | cutcall
    mode: str = "ok"
    words: int = 0  # a longer healthy reply: REPLY's words repeated to this many (0: REPLY once)
    seen_auth: list[str] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)  # ends a stalled reply

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/models", self.models),
                                 Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def models(self, request: Request) -> Response:
        self.seen_auth.append(request.headers.get("authorization", ""))
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "fake"}]})

    async def chat(self, request: Request) -> Response:
        self.seen_auth.append(request.headers.get("authorization", ""))
        body = await request.json()
        self.requests.append(body)
        if self.mode == "error500":
            return JSONResponse({"error": {"message": "CUDA out of memory", "type": "server_error"}}, status_code=500)

        def events():
            if self.mode in ("tools", "badcall", "cutcall"):
                yield from self.tool_events()
                return
            if self.mode == "malformed":
                yield b"data: {\"choices\": [{\"delta\": {\"content\": \"The\"}}]}\n\n"
                yield b"this is not an event stream\n\n"
                return
            if self.mode == "slow_start":
                time.sleep(8)
            words = REPLY.split(" ")
            if self.words:  # as long as asked, up to `words`
                n = min(self.words, int(body.get("max_tokens") or self.words))
                words = (words * (n // len(words) + 1))[:n]
            for i, w in enumerate(words):
                if self.mode == "truncated" and i == 3:
                    return  # ends without finish_reason or [DONE]
                if self.mode == "stall" and i == 3:
                    self.release.wait(120)  # sends nothing more while the connection stays open
                    return
                delta = {"content": (w if i == 0 else " " + w)}
                chunk = {"id": "x", "object": "chat.completion.chunk", "model": "fake-model",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 12, "completion_tokens": len(words), "total_tokens": 12 + len(words)}}
            yield f"data: {json.dumps(end)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def tool_events(self):
        """Reasoning, a little content, then two calls whose names and arguments arrive in pieces, the
        id only in a call's first delta (as vLLM and SGLang stream them)."""
        args = '{"city": "Paris"' if self.mode in ("badcall", "cutcall") else '{"city": "Paris", "days": 2}'
        deltas = [{"reasoning_content": "The user wants"}, {"reasoning_content": " the weather."},
                  {"content": "Checking."},
                  {"tool_calls": [{"index": 0, "id": "call_up_1", "type": "function",
                                   "function": {"name": "get_", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": args[:9]}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": args[9:]}}]},
                  {"tool_calls": [{"index": 1, "id": "call_up_2", "type": "function",
                                   "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]
        for d in deltas:
            chunk = {"id": "x", "object": "chat.completion.chunk", "model": "fake-model",
                     "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length" if self.mode == "cutcall" else "tool_calls"}],
               "usage": {"prompt_tokens": 30, "completion_tokens": 25, "total_tokens": 55}}
        yield f"data: {json.dumps(end)}\n\n".encode()
        yield b"data: [DONE]\n\n"


if __name__ == "__main__":  # its own process, for benchmarks/remote.py: an upstream that costs nothing
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--words", type=int, default=0)
    a = ap.parse_args()
    uvicorn.run(FakeUpstream(words=a.words).app(), host="127.0.0.1", port=a.port, log_level="warning")
