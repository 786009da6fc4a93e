"""`llmd pull` and Ollama's /api/pull, /api/copy, /api/delete with the real huggingface_hub client
against a local stand-in for the Hub (tests/hub_server.py) serving the packaged SmolLM2 GGUF,
whole and split in three: a pull that loads and answers, an interrupted pull that resumes with a
Range request, a checksum mismatch that registers nothing, a repo without the quantization asked
for, and removal that deletes only what llmd downloaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Daemon, token
from gguf_split import split
from hub_server import FakeHub, HubServer

from llmd.models.catalog import find_packaged

# the ollama client keeps pooled connections that close at garbage collection, not in the test
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
REPO = "test-org/SmolLM2-135M-Instruct-GGUF"
SPLIT_REPO = "test-org/SmolLM2-Split-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    src = find_packaged()["smollm2-135m"]
    d = tmp_path_factory.mktemp("hubfiles")
    whole = d / FILE
    os.link(src, whole)
    parts = split(src, d / "SmolLM2-Split-Q4_1", 3)
    return {FILE: whole, **{p.name: p for p in parts}}


@pytest.fixture
def hub(files: dict[str, Path]) -> Iterator[tuple[FakeHub, HubServer]]:
    fake = FakeHub()
    fake.add(REPO, {FILE: files[FILE]})
    fake.add(SPLIT_REPO, {n: p for n, p in files.items() if "-of-" in n})
    with HubServer(fake) as server:
        yield fake, server


def env_for(home: Path, server: HubServer) -> dict[str, str]:
    d = Daemon(home)
    return {**d.env, "HF_ENDPOINT": server.url, "HF_HOME": str(home / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def llmd(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmd", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def registered(env: dict[str, str]) -> dict[str, dict]:
    from llmd.models.registry import Registry

    home = Path(env["LLMD_HOME"])
    db = home / "data" / "registry.db"
    return {r["name"]: r for r in Registry(db, home / "data" / "models").list()} if db.exists() else {}


def test_pull_picks_the_closest_quantization_registers_loads_and_rm_deletes_it(tmp_path: Path, hub):
    fake, server = hub
    env = env_for(tmp_path / "home", server)
    r = llmd(env, "pull", REPO)  # Q4_K_M asked for (the default), the repo has Q4_1
    assert r.returncode == 0, r.stderr
    assert "has no Q4_K_M file; pulling the closest it has, Q4_1" in r.stderr
    row = registered(env)["smollm2-135m-instruct:q4_1"]
    path = Path(row["path"])
    assert row["source"] == "pulled" and path.is_file() and path.is_relative_to(tmp_path / "home")
    import hashlib

    assert row["digest"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()  # the Hub's, checked
    again = llmd(env, "pull", REPO)
    assert again.returncode == 0 and "was already pulled" in again.stderr, again.stderr
    assert fake.downloads == [FILE]  # nothing downloaded twice
    d = Daemon(tmp_path / "home", env={k: env[k] for k in ("HF_ENDPOINT", "HF_HOME")}).start()
    try:
        c = httpx.post(d.url + "/v1/chat/completions", timeout=300, json={
            "model": "smollm2-135m-instruct:q4_1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert c.status_code == 200 and c.json()["choices"][0]["message"]["content"], c.text
        tags = [m["name"] for m in httpx.get(d.url + "/api/tags").json()["models"]]
        assert "smollm2-135m-instruct:q4_1" in tags
        rm = llmd(d.env, "models", "rm", "smollm2-135m-instruct:q4_1")
        assert rm.returncode == 0 and "deleted the file" in rm.stdout, rm.stdout + rm.stderr
        assert not path.exists()
    finally:
        d.stop()


def test_a_split_model_is_pulled_whole_and_loads(tmp_path: Path, hub):
    _, server = hub
    env = env_for(tmp_path / "home", server)
    r = llmd(env, "pull", f"{SPLIT_REPO}:Q4_1", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    parts = sorted(Path(row["path"]).parent.glob("*-of-00003.gguf"))
    assert [p.name for p in parts] == [f"SmolLM2-Split-Q4_1-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert row["path"].endswith("-00001-of-00003.gguf")
    d = Daemon(tmp_path / "home").start()
    try:
        c = httpx.post(d.url + "/api/generate", timeout=300, json={
            "model": row["name"], "prompt": "Hello", "stream": False, "options": {"num_predict": 4}})
        assert c.status_code == 200 and c.json()["response"], c.text
        assert llmd(d.env, "models", "rm", row["name"]).returncode == 0
        assert not any(p.exists() for p in parts)  # every part was llmd's
    finally:
        d.stop()


def test_an_interrupted_pull_resumes_with_a_range_request(tmp_path: Path, hub):
    fake, server = hub
    fake.rate = 8 * 2**20  # 8 MiB/s: about 12 s for the file
    env = env_for(tmp_path / "home", server)
    # Ctrl-C's default: a shell's background job (`cmd &`) starts with SIGINT ignored, and its
    # children inherit that (Python then never raises KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-m", "llmd", "pull", REPO + ":Q4_1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    part = tmp_path / "home" / "data" / "models" / "hf" / REPO.replace("/", "--") / (FILE + ".part")
    deadline = time.monotonic() + 60
    while (not part.exists() or part.stat().st_size < 10 * 2**20) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "nothing was registered" in err and "resume" in err
    kept = part.stat().st_size
    assert kept >= 10 * 2**20 and registered(env).get("smollm2-135m-instruct:q4_1") is None
    fake.rate = 0
    r = llmd(env, "pull", REPO + ":Q4_1")
    assert r.returncode == 0, r.stderr
    assert any(int(h.removeprefix("bytes=").split("-")[0]) >= kept for h in fake.ranges), fake.ranges
    row = registered(env)["smollm2-135m-instruct:q4_1"]
    assert Path(row["path"]).read_bytes() == find_packaged()["smollm2-135m"].read_bytes()


def test_a_checksum_mismatch_registers_nothing_and_keeps_nothing(tmp_path: Path, hub):
    fake, server = hub
    fake.corrupt.add(FILE)
    env = env_for(tmp_path / "home", server)
    r = llmd(env, "pull", REPO + ":Q4_1")
    assert r.returncode != 0
    assert "does not match the sha256 the Hub lists" in r.stderr and "nothing was registered" in r.stderr
    assert registered(env).get("smollm2-135m-instruct:q4_1") is None
    folder = tmp_path / "home" / "data" / "models" / "hf" / REPO.replace("/", "--")
    assert not list(folder.glob("*.gguf*"))


def test_unknown_files_and_repos_are_named_in_the_error(tmp_path: Path, hub):
    _, server = hub
    env = env_for(tmp_path / "home", server)
    r = llmd(env, "pull", REPO + "/nothing-Q8_0.gguf")
    assert r.returncode != 0 and "has no file 'nothing-Q8_0.gguf'" in r.stderr and FILE in r.stderr
    r = llmd(env, "pull", "test-org/missing-GGUF")
    assert r.returncode != 0 and "has no model 'test-org/missing-GGUF'" in r.stderr


def test_a_listed_file_name_outside_the_models_folder_is_refused(tmp_path: Path, hub, files: dict[str, Path]):
    fake, server = hub
    fake.add("test-org/Evil-GGUF", {"../../../evil-Q4_1.gguf": files[FILE]})
    env = env_for(tmp_path / "home", server)
    r = llmd(env, "pull", "test-org/Evil-GGUF:Q4_1")
    assert r.returncode != 0 and "outside" in r.stderr, r.stderr
    assert not list(tmp_path.rglob("evil*")) and not fake.downloads
    assert not [n for n in registered(env) if "evil" in n.lower()]


def test_a_streamed_pull_that_cannot_reach_the_hub_ends_with_an_error_line(tmp_path: Path):
    from conftest import free_port

    d = Daemon(tmp_path / "home", env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
                                       "HF_HOME": str(tmp_path / "hf")}).start()
    try:
        with httpx.stream("POST", d.url + "/api/pull", json={"model": "hf.co/org/repo:Q4_K_M"}, headers=token(d),
                          timeout=120) as r:
            lines = [json.loads(x) for x in r.iter_lines() if x]
        assert r.status_code in (200, 502), lines
        assert "error" in lines[-1] and "org/repo" in lines[-1]["error"], lines
        r = httpx.post(d.url + "/api/pull", json={"model": "hf.co/org/repo:Q4_K_M", "stream": False}, headers=token(d),
                       timeout=120)
        assert r.status_code == 502 and "org/repo" in r.json()["error"], r.text
        r = httpx.post(d.url + "/api/pull", json={"model": "hf.co/../etc/x.gguf"}, headers=token(d), timeout=60)
        assert r.status_code == 400 and "USER/REPO" in r.json()["error"], r.text
    finally:
        d.stop()


def test_ollama_pull_copy_delete(tmp_path: Path, hub):
    import gc

    import ollama

    _, server = hub
    env = env_for(tmp_path / "home", server)
    d = Daemon(tmp_path / "home", env={k: env[k] for k in ("HF_ENDPOINT", "HF_HOME")}).start()
    try:
        # the token, as a client configured with it sends it (CI runs as root, which the same-user rule never exempts)
        c = ollama.Client(host=d.url, headers=token(d))
        ref = f"hf.co/{REPO}:Q4_1"
        statuses = [p for p in c.pull(ref, stream=True)]
        assert statuses[0].status == "pulling manifest" and statuses[-1].status == "success"
        sized = [p for p in statuses if p.total]
        assert sized and sized[-1].completed == sized[-1].total == find_packaged()["smollm2-135m"].stat().st_size
        assert sized[-1].digest.startswith("sha256:")
        # the Hub reference names the model, as in Ollama
        reply = c.chat(model=ref, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 4})
        assert reply.message.content
        assert c.pull("smollm2-135m").status == "success"  # registered already: nothing to do
        c.copy("smollm2-135m-instruct:q4_1", "my-smol")
        names = [m.model for m in c.list().models]
        assert "my-smol:latest" in names and "smollm2-135m-instruct:q4_1" in names
        path = Path(registered(env)["my-smol"]["path"])
        c.delete("smollm2-135m-instruct:q4_1")
        assert path.exists()  # the copy still uses the file
        c.delete("my-smol")
        assert not path.exists()  # the last name of a pulled file: deleted
        with pytest.raises(ollama.ResponseError, match="Hugging Face Hub"):
            c.pull("llama3.2")
        r = httpx.post(d.url + "/api/pull", json={"model": "hf.co/test-org/missing-GGUF", "stream": False},
                       headers=token(d), timeout=60)
        assert r.status_code == 404 and "has no model" in r.json()["error"]
        del c
        gc.collect()  # its pooled connections close here, under this module's warning filters
    finally:
        d.stop()
