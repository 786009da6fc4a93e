"""A busy desktop: with LLMD_THREADS=auto the engine gives up the threads other programs' cores are
taken by, and takes them back when those programs stop; a fixed LLMD_THREADS never changes."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import Daemon

from llmd.backends.llamacpp.threads import TAKEN

pytestmark = pytest.mark.integration
BUSY = "while True: pass"


@contextmanager
def generating(d: Daemon) -> Iterator[None]:
    """Keep the engine decoding (the thread count is reconsidered only while it works)."""
    stop = threading.Event()

    def loop() -> None:
        with d.client() as c:
            while not stop.is_set():
                c.post("/v1/chat/completions", headers={"Cache-Control": "no-store"}, json={
                    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
                    "max_tokens": 60, "temperature": 0.8})

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(60)


def threads(d: Daemon) -> dict | None:
    """The engine's thread figures, or None while it has never answered a status question in time
    (a step longer than the status wait on a machine this busy; later answers fall back to the last)."""
    loaded = httpx.get(d.url + "/llmd/status", timeout=30).json()["loaded"]
    return loaded[0]["stats"].get("threads")


def wait_for(check: Callable[[dict], bool], d: Daemon, seconds: float) -> tuple[bool, list[dict]]:
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t = threads(d)
        if t is not None:
            seen.append(t)
            if check(t):
                return True, seen
        time.sleep(0.25)
    return False, seen


@pytest.fixture(scope="module")
def auto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("busy") / "home", env={"LLMD_THREADS": "auto"}).start()
    yield d
    d.stop()


def test_auto_threads_back_off_while_another_program_is_busy(auto: Daemon, tmp_path: Path):
    with generating(auto):
        ok, seen = wait_for(lambda t: t["threads"] == t["most"], auto, 10)
        assert ok and seen[-1]["auto"], seen  # a quiet machine: all of them
        most = seen[-1]["most"]
        if most < 2:
            pytest.skip("one core: there is no thread to give up")
        busy = subprocess.Popen([sys.executable, "-c", BUSY])
        try:
            ok, seen = wait_for(lambda t: t["threads"] < most, auto, 5)
            assert ok, seen
            # the busy loop shares the cores with llmd's own threads, so it may show as a little under one core:
            # what counts is that it passed the governor's own threshold
            assert "other programs keep" in seen[-1]["reason"] and seen[-1]["others_cores"] >= TAKEN, seen[-1]
        finally:
            busy.kill()
            busy.wait()
        ok, seen = wait_for(lambda t: t["threads"] == most, auto, 5)
        assert ok, seen
    r = subprocess.run([sys.executable, "-m", "llmd", "status"], env={**auto.env, "COLUMNS": "300"},
                       capture_output=True, text=True, timeout=60)
    # the count itself was checked above; the CLI's own start-up is CPU another program uses, so by the
    # time it asks, the count may have dropped again
    assert re.search(rf"smollm2-135m: threads [1-{most}] of {most}: ", r.stdout), r.stdout
    metrics = httpx.get(auto.url + "/metrics", timeout=30).text
    assert re.search(r'^llmd_threads\{backend="llama.cpp",model="smollm2-135m"\} [1-9]', metrics, re.M), metrics
    assert "llmd_other_programs_cores{" in metrics


def test_fixed_threads_never_change(tmp_path: Path):
    d = Daemon(tmp_path / "home", env={"LLMD_THREADS": "2"}).start()
    try:
        busy = subprocess.Popen([sys.executable, "-c", BUSY])
        try:
            with generating(d):
                ok, seen = wait_for(lambda t: t["threads"] != 2, d, 3)
        finally:
            busy.kill()
            busy.wait()
        assert not ok and seen and seen[-1] == {**seen[-1], "threads": 2, "auto": False}, seen
        assert seen[-1]["reason"] == "fixed at 2 (LLMD_THREADS)"
    finally:
        d.stop()


def test_exact_keeps_its_threads_and_its_answer_while_another_program_is_busy(tmp_path: Path):
    """The exact policy's greedy answer must not depend on what else runs: llama.cpp's decode logits
    change with the thread count, and a busy loop beside the daemon (auto threads backing off)
    flipped this answer's near-tie in 5 of 6 runs before exact kept its count."""
    from test_caches import long_chat

    d = Daemon(tmp_path / "home", env={"LLMD_THREADS": "auto", "LLMD_EXACT": "1", "LLMD_SPECULATION": "off",
                                       "LLMD_SLOTS": "1"}).start()

    def answer() -> str:
        r = httpx.post(d.url + "/v1/chat/completions", timeout=300, headers={"Cache-Control": "no-store"},
                       json={"messages": long_chat("Who saved the sailors in 1893?"), "temperature": 0,
                             "max_tokens": 40, "cache_prompt": False})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    try:
        quiet = answer()
        busy = subprocess.Popen([sys.executable, "-c", BUSY])
        try:
            time.sleep(0.5)
            loaded = [answer() for _ in range(2)]
            t = threads(d)
        finally:
            busy.kill()
            busy.wait()
        assert loaded == [quiet, quiet]
        assert t == {**t, "threads": t["most"], "auto": False}, t
        assert "exact" in t["reason"], t
    finally:
        d.stop()
