"""Helpers the benchmarks share: start llmd and peers on free ports, stream a chat, summarise."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# the benchmarks import llmd from this checkout, as the daemons they start run it (`python -m llmd`
# in ROOT): an editable install may point at another checkout, or at one that is gone
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout}s")


def bench_home() -> Path:
    """A new data dir for a benchmark's daemon, removed when the benchmark ends (each holds a
    prefix cache of hundreds of MB: runs left behind filled the disk) unless LLMD_BENCH_KEEP=1,
    for reading its logs afterwards."""
    home = Path(tempfile.mkdtemp(prefix="llmd-bench-"))
    if os.environ.get("LLMD_BENCH_KEEP") != "1":
        atexit.register(shutil.rmtree, home, True)
    return home


def start_llmd(env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, Path]:
    home = bench_home()
    port = free_port()
    full_env = {**os.environ, "LLMD_HOME": str(home), "LLMD_PORT": str(port), **(env or {})}
    log = (home / "daemon.out").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "llmd", "serve"], env=full_env, stdout=log, stderr=log, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/llmd/health", timeout=1.0).json()["loaded"]:
                return proc, url, home
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"llmd exited: {(home / 'daemon.out').read_text()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError("llmd did not load its model in 180 s")


def start_llmd_with(models: dict[str, str], env: dict[str, str] | None = None,
                    home: Path | None = None) -> tuple[subprocess.Popen, str, Path]:
    """llmd serving GGUF files registered under the given names (the first is the default model),
    loaded before this returns. With `home`, a daemon that ran there before (models registered)."""
    fresh = home is None
    home = home or bench_home()
    name = next(iter(models))
    full_env = {**os.environ, "LLMD_HOME": str(home), "LLMD_PORT": str(free_port()), "LLMD_MODEL": name,
                "LLMD_PRELOAD": "0", **(env or {})}
    log = (home / "daemon.out").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "llmd", "serve"], env=full_env, stdout=log, stderr=log, cwd=ROOT)
    url = f"http://127.0.0.1:{full_env['LLMD_PORT']}"
    wait_http(url + "/llmd/health", proc)
    for n, path in models.items() if fresh else ():
        subprocess.run([sys.executable, "-m", "llmd", "models", "add", path, "--name", n], env=full_env, check=True,
                       capture_output=True, cwd=ROOT)
    httpx.post(url + "/v1/chat/completions", timeout=600, headers={"Cache-Control": "no-store"},
               json={"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).raise_for_status()
    return proc, url, home


def cpu_name() -> str:
    """The CPU's model name, for the benchmarks' headers."""
    return next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")), "?")


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Wait until llmd's engines have no idle work left (re-prefilling a reply, saving a prefix):
    it uses the CPU, and a peer measured meanwhile would be slowed by it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loaded = httpx.get(url + "/llmd/status", timeout=10).json()["loaded"]
        if not any((m.get("stats") or {}).get("idle_work") for m in loaded):
            return
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


@dataclass
class Sample:
    ttft_s: float
    tokens: int
    decode_tps: float
    text: str


def from_times(t0: float, arrivals: list[float], text: str, tokens: int | None = None) -> Sample:
    n = tokens if tokens is not None else len(arrivals)
    ttft = arrivals[0] - t0 if arrivals else float("nan")
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    # pieces may carry more than one token; count tokens after the first over the span
    tps = (n - 1) / span if span > 0 and n > 1 else float("nan")
    return Sample(ttft, n, tps, text)


def stream_openai_chat(url: str, body: dict, client: httpx.Client | None = None) -> Sample:
    """Stream /v1/chat/completions; time first and last content chunks as the client sees them."""
    c = client or httpx.Client(timeout=600)
    arrivals: list[float] = []
    pieces: list[str] = []
    usage_tokens = None
    t0 = time.perf_counter()
    with c.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    arrivals.append(time.perf_counter())
                    pieces.append(piece)
    return from_times(t0, arrivals, "".join(pieces), usage_tokens)


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")
