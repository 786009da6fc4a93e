"""Shared fixtures: every test gets its own LLMD_HOME; integration tests get a real daemon."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fetch_models  # noqa: E402  (scripts/: the real models' fetcher)


def hf_folder(root: Path) -> Path:
    """A tiny Hugging Face checkpoint folder: config, tokenizer config, one safetensors shard."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192,
                                                  "torch_dtype": "bfloat16",
                                                  "quantization_config": {"quant_method": "fp8"}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    header = json.dumps({"a.weight": {"dtype": "F8_E4M3", "shape": [4, 8], "data_offsets": [0, 32]},
                         "b.weight": {"dtype": "BF16", "shape": [8], "data_offsets": [32, 48]}}).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(48))
    return root



@pytest.fixture(autouse=True)
def llmd_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "llmd-home"
    monkeypatch.setenv("LLMD_HOME", str(home))
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """A real `llmd serve` process on a free port with its own data dir."""

    def __init__(self, home: Path, env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.home = home
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # speculation off unless a test asks: the determinism tests check bit-exact output, which is
        # what `off` promises (README: Reproducible output); speculation tests set their modes
        self.env = {**os.environ, "LLMD_HOME": str(home), "LLMD_PORT": str(self.port), "LLMD_SPECULATION": "off",
                    **(env or {})}
        self.log = home / "daemon.out"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_model: bool = True, timeout: float = 120.0) -> Daemon:
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmd", "serve"], env=self.env, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmd exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                r = httpx.get(self.url + "/llmd/health", timeout=1.0)
                if r.status_code == 200 and (not wait_model or r.json()["loaded"]):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llmd did not become healthy in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0, **kw)  # type: ignore[arg-type]

    def requests_logged(self, request_id: str = "", wait: float = 0.0) -> list[dict]:
        """The request log's lines (logs/llmd.log, `llmd.requests`), or one request's; waits up to
        `wait` s for at least one (a line is written when its request ends)."""
        deadline = time.monotonic() + wait
        while True:
            log = self.home / "logs" / "llmd.log"
            lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
            got = [e for e in lines if e.get("msg") == "request" and (not request_id or e.get("request_id") == request_id)]
            if got or time.monotonic() >= deadline:
                return got
            time.sleep(0.2)


def computed_again(url: str) -> int:
    """Prompt tokens a fast-policy request computes when its whole prompt is cached: the last one,
    or, attending by matrix products, the last two together (prompt_rows.LAST_ROWS: one alone gets other
    logits than it got cold)."""
    from llmd.backends.llamacpp.prompt_rows import LAST_ROWS

    attention = httpx.get(url.rstrip("/") + "/llmd/status").json()["loaded"][0]["attention"]
    return 1 if attention == "flash" else LAST_ROWS


def token(d: Daemon) -> dict[str, str]:
    """The header that authorizes control routes (the token the daemon wrote in its config dir)."""
    return {"Authorization": "Bearer " + (d.home / "config" / "token").read_text().strip()}


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon") / "home").start()
    yield d
    d.stop()


@pytest.fixture
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with daemon.client() as c:
        yield c


def llmd(d: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmd", *args], env={**d.env, "COLUMNS": "300"},
                          capture_output=True, text=True, timeout=600)


def start_with_models(home: Path, env: dict[str, str], names: tuple[str, ...]) -> Daemon:
    """A daemon with the real models registered (`llmd models add`), nothing preloaded."""
    paths = {name: fetch_models.ensure(name) for name in names}
    d = Daemon(home, env={"LLMD_PRELOAD": "0", "LLMD_MAX_LOADED": "2", **env})
    d.env.pop("LLMD_SPECULATION")  # the real default: auto
    d.start(wait_model=False)
    for name, path in paths.items():
        r = llmd(d, "models", "add", str(path), "--name", name)
        assert r.returncode == 0, r.stderr
    return d
