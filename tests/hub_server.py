"""A local stand-in for the Hugging Face Hub, for pull tests (there is no network here): the
routes huggingface_hub calls, serving real files. Model info with file metadata (sizes, LFS
sha256), and `resolve` with the Hub's headers (X-Repo-Commit, ETag, X-Linked-Etag,
X-Linked-Size) and Range requests. Switches: `corrupt` serves other bytes than the listed sha256,
`rate` slows the body (bytes per second), `ranges` records every Range header received."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from thread_server import ThreadServer

from llmd.models.digest import file_digest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    repos: dict[str, dict[str, Path]] = field(default_factory=dict)  # repo -> {filename: file}
    corrupt: set[str] = field(default_factory=set)
    rate: float = 0.0
    ranges: list[str] = field(default_factory=list)
    downloads: list[str] = field(default_factory=list)  # files whose body was sent (GET)
    _sha: dict[Path, str] = field(default_factory=dict)

    def add(self, repo: str, files: dict[str, Path]) -> None:
        self.repos[repo] = files
        for p in files.values():
            if p not in self._sha:
                self._sha[p] = file_digest(p).removeprefix("sha256:")

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/api/models/{org}/{repo}", self.info),
            Route("/api/models/{org}/{repo}/revision/{rev}", self.info),
            Route("/{org}/{repo}/resolve/{rev}/{filename:path}", self.resolve, methods=["GET", "HEAD"]),
        ])

    async def info(self, request: Request) -> Response:
        repo = f"{request.path_params['org']}/{request.path_params['repo']}"
        if repo not in self.repos:
            return JSONResponse({"error": "Repository not found"}, status_code=404,
                                headers={"X-Error-Code": "RepoNotFound"})
        siblings = [{"rfilename": name, "size": p.stat().st_size,
                     "lfs": {"sha256": self._sha[p], "size": p.stat().st_size, "pointerSize": 134}}
                    for name, p in self.repos[repo].items()]
        siblings.append({"rfilename": "README.md", "size": 10})
        return JSONResponse({"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings,
                             "tags": ["gguf"]})

    async def resolve(self, request: Request) -> Response:
        repo = f"{request.path_params['org']}/{request.path_params['repo']}"
        name = request.path_params["filename"]
        path = self.repos.get(repo, {}).get(name)
        if path is None:
            return JSONResponse({"error": "Entry not found"}, status_code=404, headers={"X-Error-Code": "EntryNotFound"})
        size = path.stat().st_size
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{self._sha[path]}"', "X-Linked-Etag": f'"{self._sha[path]}"',
                   "X-Linked-Size": str(size), "Accept-Ranges": "bytes"}
        start = 0
        rng = request.headers.get("range")
        if rng:
            self.ranges.append(rng)
            start = int(rng.removeprefix("bytes=").split("-")[0])
        if request.method == "HEAD":
            return Response(headers={**headers, "Content-Length": str(size)})
        self.downloads.append(name)
        corrupt, rate = name in self.corrupt, self.rate

        def body():
            with path.open("rb") as f:
                f.seek(start)
                while chunk := f.read(1 << 16):
                    if corrupt and f.tell() == start + len(chunk):  # one byte changed, the size kept
                        chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                    yield chunk
                    if rate:
                        time.sleep(len(chunk) / rate)

        status = 206 if rng else 200
        headers["Content-Length"] = str(size - start)
        if rng:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        return StreamingResponse(body(), status_code=status, headers=headers,
                                 media_type="application/octet-stream")


class HubServer(ThreadServer):
    """Serves a FakeHub on a free loopback port, in a thread."""

    def __init__(self, hub: FakeHub) -> None:
        super().__init__(hub.app())
