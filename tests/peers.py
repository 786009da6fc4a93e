"""llama.cpp's own llama-server, built by scripts/build-llama-server.sh from the llama.cpp that
llama-cpp-python vendors, run as a real upstream on a free port."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

PEER_BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmd-peers/llama.cpp-0.3.36/build/bin"


def has_amx() -> bool:
    try:
        return "amx" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


class LlamaServer:
    def __init__(self, model: Path, log: Path, alias: str = "smol", slots: int = 2) -> None:
        exe = PEER_BIN / "llama-server"
        if not exe.exists():
            if os.environ.get("CI") == "true":
                pytest.fail(f"{exe} is missing: scripts/install-test-deps.sh builds it (scripts/build-llama-server.sh)")
            pytest.skip(f"llama-server is not built ({exe}); run scripts/build-llama-server.sh")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-c", "4096",
                "-np", str(slots), "-a", alias, "--metrics", "-t", "2"]
        if has_amx():
            args.append("--no-repack")  # this llama.cpp's repacked kernels crash on AMX
        self.log = log
        self.proc = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT)

    def start(self, timeout: float = 120.0) -> LlamaServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not come up: " + self.log.read_text()[-2000:])

    def processing(self) -> int:
        """Slots working on a request now (its /slots monitor; the Prometheus gauge lags)."""
        return sum(1 for slot in httpx.get(self.url + "/slots", timeout=5).json() if slot.get("is_processing"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
