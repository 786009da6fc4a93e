"""Host and Origin checks and the request body bound, as pure ASGI middleware.

A web page can make a browser send requests to 127.0.0.1 under a name it controls (DNS
rebinding): such requests carry that name in Host, so only loopback names (and the address
the daemon was told to bind) are served. Browser requests from other origins are refused
unless the user allowed them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmd.config import Settings
from llmd.daemon.peer import same_user
from llmd.errors import Forbidden, LlmdError, PayloadTooLarge, Unauthorized

log = logging.getLogger("llmd.security")

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


def _hostname(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def host_allowed(host: str, settings: Settings) -> bool:
    name = _hostname(host)
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    bound = settings.host.lower()
    return bound not in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::") and name in (bound, f"[{bound}]")


def origin_allowed(origin: str, settings: Settings) -> bool:
    if origin == "null":
        return False
    parts = urlsplit(origin)
    if parts.scheme in ("http", "https") and parts.hostname and (
        parts.hostname in LOOPBACK_NAMES or parts.hostname.endswith(".localhost")
    ):
        return True
    allowed = {o.strip().rstrip("/") for o in settings.allowed_origins.split(",") if o.strip()}
    return origin.rstrip("/") in allowed or "*" in allowed


def error_body(path: str, err: LlmdError) -> dict[str, Any]:
    """Each API's error shape: Ollama's {"error": "..."} under /api, Anthropic's under /v1/messages,
    OpenAI's elsewhere."""
    if path.startswith("/api/"):
        return {"error": err.message}
    if path.startswith("/v1/messages"):
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                503: "overloaded_error"}.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


class SecurityMiddleware:
    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not host_allowed(host, self.settings):
            return await send_error(scope, send, Forbidden(
                f"Host {host!r} is not a loopback name; llmd only answers requests addressed to localhost "
                "(this blocks DNS-rebinding attacks from web pages)"))
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, self.settings):
            return await send_error(scope, send, Forbidden(
                f"browser requests from origin {origin!r} are not allowed; add it to LLMD_ALLOWED_ORIGINS to allow it"))
        if origin is not None:
            cors = _cors_headers(origin, headers)
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await send({"type": "http.response.start", "status": 204, "headers": cors})
                await send({"type": "http.response.body", "body": b""})
                return
            send = _with_headers(send, cors[:3])
        limit = self.settings.max_body
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await send_error(scope, send, PayloadTooLarge(
                f"the request body is {int(length)} bytes; the limit is {limit} (LLMD_MAX_BODY)"))
        seen = 0

        async def bounded_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise PayloadTooLarge(f"the request body is over the {limit}-byte limit (LLMD_MAX_BODY)")
            return message

        await self.app(scope, bounded_receive, send)


def _cors_headers(origin: str, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """CORS for an allowed origin (the caller checked it): that origin only, never '*'."""
    asked = headers.get("access-control-request-headers", "authorization, content-type")
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-expose-headers", b"X-LLMD-Cache, X-LLMD-Dropped-Messages, X-Request-Id, Retry-After"),
            (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
            (b"access-control-allow-headers", asked.encode("latin-1")), (b"access-control-max-age", b"600")]


def _with_headers(send: Any, extra: list[tuple[bytes, bytes]]) -> Any:
    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)
    return sending


async def send_error(scope: Any, send: Any, err: LlmdError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An error answered from middleware, in the API's own shape (error_body)."""
    body = json.dumps(error_body(scope.get("path", ""), err)).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def token_path(config_dir: Path) -> Path:
    return config_dir / "token"


TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{32,}")  # what secrets.token_urlsafe(32) writes (43 characters)


def load_or_create_token(config_dir: Path) -> str:
    """The bearer token for control routes: made on first start, readable by the user only. A file
    that is empty, cut short or not a token (a crash mid-write, an edit) is replaced, never trusted:
    an empty token would let an empty bearer through. Written whole or not at all (temp file,
    fsync, rename)."""
    path = token_path(config_dir)
    try:
        token = path.read_text().strip()
        if TOKEN_RE.fullmatch(token):
            return token
        log.warning("the token file %s is empty or malformed; writing a new token", path)
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    _write_private(path, (token + "\n").encode())
    return token


def load_or_create_key(path: Path) -> bytes:
    """A 32-byte secret in a file only the user reads (the prefix cache's HMAC key): made once,
    never trusted short."""
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
        log.warning("the key file %s is not 32 bytes; writing a new key (entries signed with the old one are dropped)",
                    path)
    except FileNotFoundError:
        pass
    key = secrets.token_bytes(32)
    _write_private(path, key)
    return key


def _write_private(path: Path, data: bytes) -> None:
    """Written whole or not at all (temp file, fsync, rename), mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def authorize(request: Any, token: str, *, reads_local_files: bool = False) -> None:
    """The one rule for routes that change the daemon or its models (llmd's control routes, and
    Ollama's pull, delete and copy): the bearer token, or a connection from a process of the user
    llmd runs as, identified exactly (llmd.daemon.peer: the client's own socket, ESTABLISHED, never
    root), so the user's own Ollama clients need no setup. Always the token: a browser (a request
    with an Origin, whatever page it loads), and routes that read files or environment variables of
    this machine (`reads_local_files`: a model path, an API key file or variable), whose contents a
    caller could have sent elsewhere. An Authorization header that is not llmd's token (an Ollama
    client configured with some other key) does not count against a same-user connection.
    Unauthorized otherwise."""
    if token_matches(request.headers, token):
        return
    if "origin" not in request.headers and not reads_local_files:
        server = request.scope.get("server")
        client = request.client and (request.client.host, request.client.port)
        # the socket tables are read in a thread: with tens of thousands of sockets open, a flood of
        # refused requests must not hold the event loop
        if await asyncio.to_thread(same_user, client, tuple(server) if server else None):
            return
    why = ("this request makes llmd read a file or an environment variable of this machine, so it always needs "
           "the daemon's token" if reads_local_files else "this route changes the daemon and needs its token")
    raise Unauthorized(f"{why}: send 'Authorization: Bearer <token>' with the token from the file 'token' in "
                       "llmd's config dir (the llmd CLI and tray do this)")


def token_matches(headers: Any, token: str) -> bool:
    assert token, "an empty token authorizes nobody"
    scheme, _, value = headers.get("authorization", "").partition(" ")
    # bytes: compare_digest refuses non-ASCII str (a TypeError would be a 500)
    return scheme.lower() == "bearer" and secrets.compare_digest(value.strip().encode("utf-8", "replace"),
                                                                  token.encode())
