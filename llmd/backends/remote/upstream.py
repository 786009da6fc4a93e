"""One upstream engine: its URL and rules, its API key (from the environment or a 0600 file, never
stored or logged), what kind of engine it is, and whether it is up.

Non-loopback URLs must be https unless the model was added with --insecure: the prompts and the
key cross the network. Health is a GET of the upstream's /v1/models (short timeout) every
HEALTH_S seconds and after any failed request; an upstream that fails is down until a check
passes again.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx

from llmd.errors import BadRequest

HEALTH_S = 5.0
CHECK_TIMEOUT_S = 3.0
KINDS = ("vllm", "sglang", "trtllm-serve", "llama-server", "ollama", "llmd", "openai-compatible")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str, insecure: bool) -> str:
    """The base URL without a trailing slash or /v1; refused unless http(s), and https off loopback."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"{url!r} is not an http(s) URL; give the upstream's base URL, e.g. "
                         "https://gpu-box:8000", "remote")
    if parts.scheme == "http" and not is_loopback(parts.hostname) and not insecure:
        raise BadRequest(f"{url} is plain http to another machine: prompts and the API key would cross the network "
                         "unencrypted. Use https, or add the model with --insecure on a network you trust", "remote")
    base = url.strip().rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def read_key(env: str | None, file: str | None) -> str | None:
    """The API key, read when needed: from the variable named `env`, or a file only its owner can read."""
    if env:
        key = os.environ.get(env)
        if not key:
            raise BadRequest(f"the API key variable {env} is not set in the daemon's environment; set it and "
                             "restart the daemon (or re-add the model with --api-key-file)", "api_key_env")
        return key.strip()
    if file:
        p = Path(file)
        try:
            st = p.stat()
        except OSError as e:
            raise BadRequest(f"the API key file {file} cannot be read: {e.strerror}", "api_key_file") from e
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise BadRequest(f"the API key file {file} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                             f"run chmod 600 {file}", "api_key_file")
        return p.read_text().strip()
    return None


@dataclass
class Upstream:
    url: str
    up: bool = True  # assumed up until a request or a check says otherwise
    in_flight: int = 0
    latency_ms: float | None = None  # of the last health check
    last_error: str = ""
    checked_at: float = 0.0
    served: int = 0
    models: list[str] = field(default_factory=list)

    def mark_down(self, why: str) -> None:
        self.up = False
        self.last_error = why

    async def check(self, client: aiohttp.ClientSession, headers: dict[str, str]) -> bool:
        t0 = time.perf_counter()
        try:
            async with client.get(self.url + "/v1/models", headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)) as r:
                r.raise_for_status()
                body = await r.json(content_type=None)
            self.models = [m.get("id", "") for m in body.get("data", [])]
            self.up, self.last_error = True, ""
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as e:
            self.mark_down(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        self.latency_ms = round((time.perf_counter() - t0) * 1000, 2)
        self.checked_at = time.time()
        return self.up

    def as_dict(self) -> dict[str, Any]:
        return {"url": self.url, "up": self.up, "in_flight": self.in_flight, "latency_ms": self.latency_ms,
                "last_error": self.last_error, "served": self.served, "models": self.models[:20]}


def detect_kind(url: str, headers: dict[str, str], timeout: float = CHECK_TIMEOUT_S) -> tuple[str, list[str]]:
    """(kind, model ids) of the engine at `url`, from its own routes; raises BadRequest when it does not
    answer /v1/models. Synchronous (run once, when the model is added), so httpx's plain client."""
    with httpx.Client(timeout=timeout, headers=headers) as c:
        try:
            r = c.get(url + "/v1/models")
            r.raise_for_status()
            data = r.json().get("data", [])
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise BadRequest(f"the upstream {url} does not answer GET /v1/models ({type(e).__name__}: {e}); is it "
                             "an OpenAI-compatible server, and up?", "remote") from e
        models = [m.get("id", "") for m in data if isinstance(m, dict)]
        owners = " ".join(str(m.get("owned_by", "")) for m in data if isinstance(m, dict)).lower()

        def answers(path: str, key: str) -> bool:
            try:
                resp = c.get(url + path)
                return resp.status_code == 200 and key in resp.text
            except httpx.HTTPError:
                return False

        if answers("/llmd/health", "status"):
            return "llmd", models
        if answers("/api/version", "version"):
            return "ollama", models
        if answers("/props", "default_generation_settings"):
            return "llama-server", models
        if "vllm" in owners:
            return "vllm", models
        if answers("/get_server_info", "model_path"):
            return "sglang", models
        if "tensorrt" in owners or "trtllm" in owners:
            return "trtllm-serve", models
        return "openai-compatible", models


def check_now(url: str, key_env: str | None, key_file: str | None) -> dict[str, Any]:
    """One health check outside the daemon (for `llmd doctor`): up, latency, models, or why not."""
    import asyncio

    async def run() -> dict[str, Any]:
        u = Upstream(url)
        try:
            key = read_key(key_env, key_file)
        except BadRequest as e:
            u.mark_down(e.message)
            return u.as_dict()
        async with aiohttp.ClientSession(trust_env=True) as client:
            await u.check(client, {"Authorization": f"Bearer {key}"} if key else {})
        return u.as_dict()

    return asyncio.run(run())
