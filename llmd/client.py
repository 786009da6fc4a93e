"""httpx client for the daemon API; the CLI and the tray talk to the daemon only through this."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

from llmd.config import Settings


class DaemonNotRunning(Exception):
    def __init__(self, url: str) -> None:
        super().__init__(f"llmd is not running at {url}; start it with `llmd serve` (or `llmd start`)")


class DaemonError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"llmd answered {status}: {message}")
        self.status = status


class Client:
    def __init__(self, settings: Settings, timeout: float = 600.0) -> None:
        self.base_url = settings.base_url
        self._token_file = settings.paths.config / "token"
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=2.0))

    def _auth(self) -> dict[str, str]:
        """The daemon's bearer token, read from the user's config dir (made by the daemon on first start)."""
        try:
            return {"Authorization": "Bearer " + self._token_file.read_text().strip()}
        except OSError:
            return {}

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.ConnectError:
            raise DaemonNotRunning(self.base_url) from None
        if r.status_code >= 400:
            raise DaemonError(r.status_code, _error_message(r))
        return r.json()

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/llmd/health")

    def status(self) -> dict[str, Any]:
        return self._request("GET", "/llmd/status")

    def models(self) -> list[dict[str, Any]]:
        return self._request("GET", "/llmd/models")["models"]

    def model(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/llmd/models/{quote(name, safe='')}")

    def add_model(self, path: str, name: str | None) -> dict[str, Any]:
        return self._request("POST", "/llmd/models", json={"path": path, "name": name}, headers=self._auth())

    def add_remote(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/llmd/models/remote", json=body, headers=self._auth())

    def remove_model(self, name: str) -> dict[str, Any]:
        return self._request("DELETE", f"/llmd/models/{quote(name, safe='')}", headers=self._auth())

    def use(self, name: str) -> dict[str, Any]:
        return self._request("POST", "/llmd/models/active", json={"model": name}, headers=self._auth())

    def pair(self, model: str, draft: str | None, auto: bool = False) -> dict[str, Any]:
        return self._request("POST", "/llmd/models/pair", json={"model": model, "draft": draft, "auto": auto},
                             headers=self._auth())

    def set_speculation(self, mode: str) -> dict[str, Any]:
        return self._request("POST", "/llmd/speculation", json={"mode": mode}, headers=self._auth())

    def load(self, name: str) -> dict[str, Any]:
        return self._request("POST", "/llmd/models/load", json={"model": name}, headers=self._auth())

    def cache_stats(self) -> dict[str, Any]:
        return self._request("GET", "/llmd/cache")

    def cache_clear(self, responses: bool, prefixes: bool) -> dict[str, Any]:
        return self._request("POST", "/llmd/cache/clear", json={"responses": responses, "prefixes": prefixes},
                             headers=self._auth())

    def unload(self, name: str) -> dict[str, Any]:
        return self._request("POST", "/llmd/models/unload", json={"model": name}, headers=self._auth())

    def chat_stream(self, model: str | None, messages: list[dict[str, str]], **params: Any) -> Iterator[str]:
        body = {"model": model, "messages": messages, "stream": True, **params}
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    raise DaemonError(r.status_code, _error_message(r))
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            yield text
        except httpx.ConnectError:
            raise DaemonNotRunning(self.base_url) from None


def follow_events(settings: Settings, on_state: Any, on_down: Any, stop: Any, retry_s: float = 1.0) -> None:
    """Follow /llmd/events (server-sent events), calling on_state(dict) for each state and
    on_down(reason) when the daemon is unreachable; reconnects until stop() is true."""
    url = settings.base_url + "/llmd/events"
    while not stop():
        try:
            with httpx.Client(timeout=httpx.Timeout(30.0, connect=2.0)) as c, c.stream("GET", url) as r:
                for line in r.iter_lines():
                    if stop():
                        return
                    if line.startswith("data: "):
                        on_state(json.loads(line[6:]))
        except (httpx.HTTPError, ValueError) as e:
            on_down(str(e) or type(e).__name__)
        if stop():
            return
        import time

        time.sleep(retry_s)


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
    except ValueError:
        return r.text[:200]
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)
