"""Models and the CLI as a user runs them: `llmd` subprocesses against a real daemon."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Daemon, hf_folder, token

from llmd.models.catalog import find_packaged

pytestmark = pytest.mark.integration
SMOL, GEMMA = "smollm2-135m", "gemma3-270m"


def llmd(daemon: Daemon, *args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmd", *args], env=daemon.env, capture_output=True, text=True,
                          input=input, timeout=timeout)


def loaded(daemon: Daemon) -> list[str]:
    return [m["name"].removesuffix(":latest") for m in httpx.get(daemon.url + "/api/ps").json()["models"]]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("models") / "home", env={"LLMD_SLOTS": "2", "LLMD_CTX": "1024"}).start()
    yield d
    d.stop()


def test_cli_says_when_the_daemon_is_not_running(tmp_path: Path):
    d = Daemon(tmp_path / "none")
    for args in (["status"], ["models"], ["run", SMOL, "hi"]):
        r = llmd(d, *args)
        assert r.returncode == 1
        assert "not running" in r.stderr and "llmd serve" in r.stderr
    assert llmd(d, "frobnicate").returncode == 2


def test_start_status_stop(tmp_path: Path):
    d = Daemon(tmp_path / "life")
    r = llmd(d, "start")
    assert r.returncode == 0, r.stderr
    assert "started" in r.stdout
    try:
        status = json.loads(llmd(d, "status", "--json").stdout)
        assert status["address"] == d.url and status["active_model"] == SMOL
        assert "reason" in status["backend"]
        human = llmd(d, "status").stdout
        assert "running" in human and SMOL in human and d.url in human
    finally:
        r = llmd(d, "stop")
    assert r.returncode == 0 and "stopped" in r.stdout
    assert llmd(d, "status").returncode == 1


def test_packaged_models_are_registered(two: Daemon):
    models = json.loads(llmd(two, "models", "--json").stdout)
    by = {m["name"]: m for m in models}
    assert by[SMOL]["quantization"] == "Q4_1" and by[SMOL]["active"]
    assert by[GEMMA]["arch"] == "gemma3" and by[GEMMA]["quantization"] == "Q4_K_M"
    assert by[GEMMA]["digest"].startswith("sha256:a5fd3b62")  # the package's published sha256
    out = llmd(two, "models", "show", GEMMA).stdout
    assert "memory to load" in out and "KV cache" in out


def test_add_validates_and_rm_keeps_the_file(two: Daemon, tmp_path: Path):
    good = tmp_path / "my-smol.gguf"
    shutil.copy(find_packaged()[SMOL], good)
    before = llmd(two, "models", "--json").stdout
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:40_000_000])
    r = llmd(two, "models", "add", str(cut))
    assert r.returncode == 1 and "truncated" in r.stderr
    txt = tmp_path / "notes.gguf"
    txt.write_text("hello")
    r = llmd(two, "models", "add", str(txt))
    assert r.returncode == 1 and "GGUF" in r.stderr
    assert llmd(two, "models", "--json").stdout == before  # registry unchanged

    r = llmd(two, "models", "add", str(good), "--name", "mine")
    assert r.returncode == 0, r.stderr
    m = json.loads(llmd(two, "models", "show", "mine", "--json").stdout)
    assert m["arch"] == "llama" and m["gguf"]["has_chat_template"] and m["size"] == good.stat().st_size
    assert llmd(two, "models", "add", str(good), "--name", "mine").returncode == 1  # name taken
    r = llmd(two, "models", "rm", "mine")
    assert r.returncode == 0 and "left in place" in r.stdout
    assert good.exists()
    assert "mine" not in llmd(two, "models").stdout


def test_a_name_with_slashes_is_shown_used_and_removed(two: Daemon, tmp_path: Path):
    """Imported names look like hf.co/org/repo:Q4_K_M: the routes take them whole."""
    name = "hf.co/org/smol-repo:Q4_K_M"
    good = tmp_path / "slashed.gguf"
    shutil.copy(find_packaged()[SMOL], good)
    r = llmd(two, "models", "add", str(good), "--name", name)
    assert r.returncode == 0, r.stderr
    assert json.loads(llmd(two, "models", "show", name, "--json").stdout)["name"] == name
    assert httpx.get(two.url + "/v1/models/" + name).json()["id"] == name  # unquoted, as OpenAI clients send it
    r = llmd(two, "use", name)
    assert r.returncode == 0, r.stderr
    r = llmd(two, "use", SMOL)
    assert r.returncode == 0, r.stderr
    r = llmd(two, "models", "rm", name)
    assert r.returncode == 0, r.stderr
    assert name not in llmd(two, "models").stdout
    assert llmd(two, "models", "show", name).returncode == 1


def test_control_routes_need_the_token_or_the_same_user(two: Daemon):
    """One rule for every route that changes the daemon or its models (llmd's and Ollama's pull,
    delete and copy): the token, or a connection from a process of llmd's own user, never root; a
    browser (a request with an Origin) always needs the token, and so does a route that reads a file
    here. The same-user side with two real non-root users: tests/integration/test_peer_users.py."""
    r = httpx.post(two.url + "/llmd/models/active", json={"model": GEMMA}, headers={"Origin": "http://127.0.0.1"})
    assert r.status_code == 401 and "token" in r.json()["error"]["message"]
    r = httpx.post(two.url + "/llmd/models/active", json={"model": GEMMA}, headers={"Authorization": "Bearer nope"})
    assert r.status_code in ((200,) if os.getuid() != 0 else (401,))  # another key: the same-user rule decides
    httpx.post(two.url + "/llmd/models/active", json={"model": SMOL}, headers=token(two), timeout=120)
    r = httpx.post(two.url + "/llmd/models", json={"path": "/etc/hostname"})  # reads a file: the token, always
    assert r.status_code == 401 and "file" in r.json()["error"]["message"], r.text
    r = httpx.post(two.url + "/llmd/models/remote", json={"name": "leak", "urls": ["http://127.0.0.1:9"],
                                                          "api_key_file": str(two.home / "config" / "token")})
    assert r.status_code == 401 and "file" in r.json()["error"]["message"], r.text
    if os.getuid() == 0 and shutil.which("curl"):  # another user: nobody (as root the test can be)
        for method, path, body in [("POST", "/llmd/models/active", {"model": GEMMA}),
                                   ("POST", "/api/copy", {"source": SMOL, "destination": "stolen"}),
                                   ("DELETE", "/api/delete", {"model": SMOL})]:
            out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method,
                                  "-H", "content-type: application/json", "-d", json.dumps(body), two.url + path],
                                 user=65534, capture_output=True, text=True, timeout=30)
            assert out.stdout == "401", (path, out.stdout, out.stderr)
    r = httpx.post(two.url + "/api/copy", json={"source": SMOL, "destination": "mine-too"})  # no token
    if os.getuid() == 0:
        assert r.status_code == 401, r.text  # root is never exempt: its rows are what orphaned sockets show
        r = httpx.post(two.url + "/api/copy", json={"source": SMOL, "destination": "mine-too"}, headers=token(two))
    assert r.status_code == 200, r.text
    assert "mine-too" in llmd(two, "models").stdout
    assert llmd(two, "models", "rm", "mine-too").returncode == 0
    assert httpx.get(two.url + "/llmd/status").json()["active_model"] == SMOL
    mode = (two.home / "config" / "token").stat().st_mode & 0o777
    assert mode == 0o600


def test_a_client_that_closes_right_after_sending_is_nobody(two: Daemon):
    """A client that sends a control request and closes at once leaves an orphaned socket, which
    /proc/net/tcp lists with uid 0: with llmd running as root that row once passed for llmd's own
    user and changed the speculation mode with no token."""
    import socket

    before = httpx.get(two.url + "/llmd/status").json()["speculation"]
    body = json.dumps({"mode": "draft" if before != "draft" else "ngram"}).encode()
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", two.port))
        s.sendall(b"POST /llmd/speculation HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        s.close()
    time.sleep(1.0)
    assert httpx.get(two.url + "/llmd/status").json()["speculation"] == before


def test_run_reads_stdin_and_streams(two: Daemon):
    r = llmd(two, "run", SMOL, "--max-tokens", "5", "--temperature", "0", input="Say hello.")
    assert r.returncode == 0 and r.stdout.strip()
    r = llmd(two, "chat", SMOL, "--max-tokens", "5", input="Hi\nAnd again?\n\n")
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) >= 2


def test_on_demand_load_is_shared_and_bounded(two: Daemon):
    body = {"model": GEMMA, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    with cf.ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda _: httpx.post(two.url + "/v1/chat/completions", json=body, timeout=120), range(4)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    assert all(r.json()["model"] == GEMMA for r in rs)
    # loaded once (one worker for all four), beside the model already loaded (memory allows both)
    assert sorted(loaded(two)) == sorted([SMOL, GEMMA])
    log = (two.home / "daemon.out").read_text()
    assert log.count(f"loaded {GEMMA} in worker") == 1


def test_switch_under_load_finishes_the_old_stream(two: Daemon):
    httpx.post(two.url + "/llmd/models/active", json={"model": SMOL}, headers=token(two), timeout=120)
    pieces: list[str] = []
    final: dict = {}

    def stream_old() -> None:
        with httpx.stream("POST", two.url + "/v1/chat/completions", timeout=300, json={
                "model": SMOL, "messages": [{"role": "user", "content": "Write a long story about a fox."}],
                "max_tokens": 150, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        final.update(chunk["usage"])
                    for ch in chunk["choices"]:
                        pieces.append(ch["delta"].get("content") or "")

    with cf.ThreadPoolExecutor(2) as pool:
        fut = pool.submit(stream_old)
        time.sleep(1.0)
        r = llmd(two, "use", GEMMA)
        assert r.returncode == 0, r.stderr
        new = httpx.post(two.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert new.json()["model"] == GEMMA
        fut.result()
    assert final["completion_tokens"] == 150, final  # the old stream ran to its end
    assert len("".join(pieces)) > 100
    # both stay loaded while memory allows: switching back reloads nothing
    pid = {m["name"]: m["pid"] for m in httpx.get(two.url + "/llmd/status").json()["loaded"]}
    assert sorted(loaded(two)) == sorted([SMOL, GEMMA])
    assert llmd(two, "use", SMOL).returncode == 0
    again = {m["name"]: m["pid"] for m in httpx.get(two.url + "/llmd/status").json()["loaded"]}
    assert again == pid, (pid, again)


def test_a_count_cap_still_unloads_the_least_recently_used(tmp_path: Path):
    """LLMD_MAX_LOADED=1, as before memory decided: a switch unloads the other model."""
    d = Daemon(tmp_path / "one", env={"LLMD_MAX_LOADED": "1", "LLMD_SLOTS": "1", "LLMD_CTX": "1024"}).start()
    try:
        assert llmd(d, "use", GEMMA).returncode == 0
        deadline = time.monotonic() + 10
        while loaded(d) != [GEMMA] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert loaded(d) == [GEMMA]
    finally:
        d.stop()


def test_memory_estimate_matches_the_workers_rss(two: Daemon):
    for name in (SMOL, GEMMA):
        httpx.post(two.url + "/llmd/models/active", json={"model": name}, headers=token(two), timeout=120)
        m = next(x for x in httpx.get(two.url + "/llmd/status").json()["loaded"] if x["name"] == name)
        est, rss = m["memory_estimate"]["total"], m["rss_load_bytes"]
        assert abs(est - rss) / rss < 0.25, (name, est, rss)
    httpx.post(two.url + "/llmd/models/active", json={"model": SMOL}, headers=token(two), timeout=120)


def test_a_load_that_cannot_fit_is_refused_with_numbers(tmp_path: Path):
    d = Daemon(tmp_path / "huge", env={"LLMD_CTX": "4000000", "LLMD_SLOTS": "1", "LLMD_PRELOAD": "0"}).start(
        wait_model=False)
    try:
        r = httpx.post(d.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=60)
        assert r.status_code == 507, r.text
        msg = r.json()["error"]["message"]
        assert "MiB" in msg and "available" in msg and "LLMD_CTX=" in msg
        assert loaded(d) == []
    finally:
        d.stop()


def test_idle_unload_and_keep_alive_zero(tmp_path: Path):
    d = Daemon(tmp_path / "idle", env={"LLMD_KEEP_ALIVE": "2s", "LLMD_SLOTS": "1", "LLMD_CTX": "512"}).start()
    try:
        assert loaded(d) == [SMOL]
        time.sleep(3.5)
        assert loaded(d) == []
        r = httpx.post(d.url + "/api/generate", timeout=120, json={
            "model": SMOL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}, "keep_alive": 0})
        assert r.status_code == 200
        deadline = time.monotonic() + 5
        while loaded(d) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loaded(d) == []
        # Ollama's empty request loads (and keep_alive -1 keeps it forever)
        r = httpx.post(d.url + "/api/generate", json={"model": SMOL, "keep_alive": -1}, timeout=120)
        assert r.json()["done_reason"] == "load"
        time.sleep(2.5)
        assert loaded(d) == [SMOL]
        assert httpx.get(d.url + "/api/ps").json()["models"][0]["expires_at"].startswith("2318")
        ps = json.loads(llmd(d, "ps", "--json").stdout)  # and says why it stays
        assert ps[0]["resident"].startswith("pinned (keep_alive -1)")
    finally:
        d.stop()


def test_port_in_use_is_reported(two: Daemon):
    env = {**two.env, "LLMD_PORT": str(two.port), "LLMD_HOME": str(two.home.parent / "other")}
    r = subprocess.run([sys.executable, "-m", "llmd", "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "already running" in r.stderr and str(two.port) in r.stderr


def test_doctor_and_status_show_the_backend_choice(two: Daemon):
    r = llmd(two, "doctor")
    assert r.returncode == 0, r.stderr
    assert "llama.cpp" in r.stdout and "not tensorrt:" in r.stdout and "LLMD_BACKEND" in r.stdout
    doc = json.loads(llmd(two, "doctor", "--json").stdout)
    assert doc["choice"]["backend"] == "llama.cpp" and doc["machine"]["physical_cores"] >= 1
    status = httpx.get(two.url + "/llmd/status").json()
    assert status["backend"]["name"] == "llama.cpp" and "CPU" in status["backend"]["reason"]
    assert any(r["option"] == "tensorrt" for r in status["backend"]["rejected"])
    assert "backend: llama.cpp" in llmd(two, "status").stdout


def test_tensorrt_override_without_tensorrt_llm_is_a_clear_error(tmp_path: Path):
    d = Daemon(tmp_path / "trt", env={"LLMD_BACKEND": "tensorrt", "LLMD_PRELOAD": "0"}).start(wait_model=False)
    try:
        r = httpx.post(d.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=120)
        assert r.status_code == 500
        assert "tensorrt_llm is not installed" in r.json()["error"]["message"]
    finally:
        d.stop()


def test_checkpoint_folder_registers_and_explains_why_it_cannot_run_here(two: Daemon, tmp_path: Path):
    folder = hf_folder(tmp_path / "llama-fp8")
    r = llmd(two, "models", "add", str(folder), "--name", "llama-fp8")
    assert r.returncode == 0, r.stderr
    out = llmd(two, "models", "show", "llama-fp8").stdout
    assert "(hf)" in out and "FP8" in out
    r = httpx.post(two.url + "/v1/chat/completions", timeout=60, json={
        "model": "llama-fp8", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500 and "TensorRT-LLM cannot run here" in r.json()["error"]["message"]
    assert llmd(two, "models", "rm", "llama-fp8").returncode == 0 and folder.exists()
