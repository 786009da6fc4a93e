"""Editors and their agents on the real Qwen2.5-Coder-1.5B: fill in the middle through the three
routes editors use (llama-server's /infill for llama.vscode and llama.vim, Ollama's /api/generate
with `suffix` for Continue and Twinny, OpenAI's /v1/completions with `suffix`), and what the
editor integrations read from the Ollama API (VS Code Copilot, Zed, Roo Code, Continue, Cline,
Goose), each as their sources read it."""

from __future__ import annotations

import ast
import gc
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import Daemon, start_with_models

pytestmark = pytest.mark.integration

QWEN, SMOL = "qwen2.5-coder-1.5b", "smollm2-135m"
PREFIX = "def mean(values: list[float]) -> float:\n    "
SUFFIX = "\n    return total / len(values)\n\n\nprint(mean([1.0, 2.0, 3.0]))\n"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = start_with_models(tmp_path_factory.mktemp("fim") / "home", {"LLMD_MODEL": QWEN, "LLMD_SLOTS": "2"},
                               (QWEN,))
    yield daemon
    daemon.stop()
    gc.collect()


def fill(d: Daemon, route: str, prefix: str, suffix: str, **extra: object) -> tuple[str, httpx.Response]:
    if route == "/infill":
        r = httpx.post(d.url + route, json={"model": QWEN, "input_prefix": prefix, "input_suffix": suffix,
                                            "n_predict": 64, "temperature": 0, "n_indent": 4, **extra}, timeout=600)
        return r.json().get("content", ""), r
    if route == "/api/generate":
        r = httpx.post(d.url + route, json={"model": QWEN, "prompt": prefix, "suffix": suffix, "stream": False,
                                            "options": {"temperature": 0, "num_predict": 64}, **extra}, timeout=600)
        return r.json().get("response", ""), r
    r = httpx.post(d.url + route, json={"model": QWEN, "prompt": prefix, "suffix": suffix, "max_tokens": 64,
                                        "temperature": 0, **extra}, timeout=600)
    return r.json()["choices"][0]["text"] if r.status_code == 200 else "", r


@pytest.mark.parametrize("route", ["/infill", "/api/generate", "/v1/completions"])
def test_each_route_fills_a_function_body_that_parses(d: Daemon, route: str):
    body, r = fill(d, route, PREFIX, SUFFIX)
    assert r.status_code == 200, r.text
    assert body.strip() and "total" in body, body
    ast.parse(PREFIX + body + SUFFIX)  # the body fits between the signature and the return


def test_other_files_chunks_are_used(d: Daemon):
    """A name defined only in another file's chunk comes back in the completion."""
    extra = [{"filename": "harbour/lamp.py", "text": "def lamp_watts_tonight() -> int:\n    return 1500\n"}]
    prefix = "from harbour.lamp import *\n\n\ndef lamp_kilowatts() -> float:\n    return "
    body, r = fill(d, "/infill", prefix, "\n", input_extra=extra)
    assert r.status_code == 200 and "lamp_watts_tonight" in body, (body, r.text)
    without, _ = fill(d, "/infill", prefix, "\n")
    assert "lamp_watts_tonight" not in without, without  # it came from the chunk
    assert r.json()["timings"]["prompt_n"] > 0 and "tokens_cached" in r.json()


def test_typing_the_proposal_is_answered_without_the_model(d: Daemon):
    prefix = "def greet(name: str) -> str:\n    "
    first, r = fill(d, "/infill", prefix, "\n")
    assert r.status_code == 200 and len(first) > 4, first
    typed = first[:3]
    rest, again = fill(d, "/infill", prefix + typed, "\n")
    assert again.headers["X-LLMD-Cache"] == "hit" and rest == first[3:], (first, rest)


def test_a_cancelled_request_frees_its_slot_at_once(d: Daemon):
    """An editor drops its request at the next keystroke: the engine stops within a step."""
    import json

    body = json.dumps({"model": QWEN, "input_prefix": "# a very long list of prime numbers\nprimes = [",
                       "input_suffix": "", "n_predict": 2000, "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", d.port))
    s.sendall(b"POST /infill HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)

    def open_requests() -> int:
        st = httpx.get(d.url + "/llmd/status", timeout=30).json()
        return sum(m["open_requests"] for m in st["loaded"])

    deadline = time.monotonic() + 60
    while open_requests() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # decoding now
    s.close()
    t0 = time.monotonic()
    while open_requests() and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    gone = time.monotonic() - t0
    # 2,000 tokens would take minutes here: the request ended with the connection
    assert open_requests() == 0 and gone < 10, gone
    done, r = fill(d, "/infill", PREFIX, SUFFIX)
    assert r.status_code == 200 and done


def test_only_fim_models_say_they_fill_in_the_middle_and_others_get_a_400(d: Daemon):
    show = httpx.post(d.url + "/api/show", json={"model": QWEN}, timeout=60).json()
    assert "{{ .Suffix }}" in show["template"] and "insert" in show["capabilities"]
    assert show["model_info"]["general.architecture"] == "qwen2" and show["model_info"]["qwen2.context_length"]
    assert show["parameters"].startswith("num_ctx ")
    smol = httpx.post(d.url + "/api/show", json={"model": SMOL}, timeout=60).json()
    assert ".Suffix" not in smol["template"] and "insert" not in smol["capabilities"]
    models = {m["name"]: m for m in httpx.get(d.url + "/llmd/models").json()["models"]}
    assert SMOL in models
    assert httpx.get(d.url + f"/llmd/models/{QWEN}").json()["fill_in_the_middle"] is True
    assert httpx.get(d.url + f"/llmd/models/{SMOL}").json()["fill_in_the_middle"] is False
    for route, body in [("/infill", {"input_prefix": "def f():\n    ", "input_suffix": "\n"}),
                        ("/api/generate", {"prompt": "def f():\n    ", "suffix": "\n", "stream": False}),
                        ("/v1/completions", {"prompt": "def f():\n    ", "suffix": "\n"})]:
        r = httpx.post(d.url + route, json={"model": SMOL, **body}, timeout=300)
        assert r.status_code == 400, (route, r.text)
        assert SMOL in r.text and "FIM prefix" in r.text, r.text


# ---- what editor integrations read ----------------------------------------------------------


def test_vscode_copilots_ollama_provider(d: Daemon):
    """It needs /api/version 0.6.4 or newer, and reads capabilities and model_info from /api/show."""
    version = httpx.get(d.url + "/api/version").json()["version"]
    assert tuple(int(x) for x in version.split(".")) >= (0, 6, 4)
    show = httpx.post(d.url + "/api/show", json={"model": QWEN}, timeout=60).json()
    info = show["model_info"]
    arch = info["general.architecture"]
    assert info[f"{arch}.context_length"] == 32768 and info["general.basename"]
    assert "completion" in show["capabilities"] and "tools" in show["capabilities"]  # Roo Code hides it otherwise


def test_zed_reads_tags_strictly_and_sends_keep_alive_minus_one(d: Daemon):
    """Zed drops the whole list when one model lacks its digest or a detail; it sends keep_alive -1
    and, with tools, stream false."""
    for m in httpx.get(d.url + "/api/tags").json()["models"]:
        assert m["digest"] and m["size"] and m["modified_at"], m
        assert set(m["details"]) >= {"parent_model", "format", "family", "families", "parameter_size",
                                     "quantization_level"}, m
        assert all(m["details"][k] is not None for k in ("format", "family", "parameter_size", "quantization_level"))
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}, "required": ["path"]}}}]
    r = httpx.post(d.url + "/api/chat", json={"model": QWEN, "keep_alive": -1, "stream": False, "tools": tools,
                                              "messages": [{"role": "user", "content": "Read the file main.py"}],
                                              "options": {"temperature": 0, "num_predict": 60}}, timeout=600)
    assert r.status_code == 200 and r.json()["done"], r.text
    ps = httpx.get(d.url + "/api/ps").json()["models"]
    assert any(m["name"].startswith(QWEN) and m["expires_at"].startswith("2318") for m in ps), ps  # kept loaded


def test_continue_reads_num_ctx_and_cline_and_goose_send_theirs(d: Daemon):
    """Continue reads num_ctx from /api/show's parameters; Cline sends num_ctx 32768 and gives up on
    a stream that has not started within 30 s; Goose sends options.num_ctx to /v1/chat/completions.
    Clients that disagree on num_ctx never reload the model at each request."""
    params = httpx.post(d.url + "/api/show", json={"model": QWEN}, timeout=60).json()["parameters"]
    assert int(params.split("num_ctx ")[1].split()[0]) >= 4096
    pid = {m["name"]: m["pid"] for m in httpx.get(d.url + "/llmd/status").json()["loaded"]}[QWEN]
    for num_ctx in (32768, 4096, 32768, 8192):
        with httpx.stream("POST", d.url + "/api/chat", json={
                "model": QWEN, "messages": [{"role": "user", "content": "Say hi."}],
                "options": {"num_ctx": num_ctx, "temperature": 0, "num_predict": 8}}, timeout=600) as r:
            lines = list(r.iter_lines())
            assert r.status_code == 200 and '"done":true' in lines[-1].replace(" ", ""), lines
    r = httpx.post(d.url + "/v1/chat/completions", json={"model": QWEN, "messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 8, "options": {"num_ctx": 16384}}, timeout=600)
    assert r.status_code == 200, r.text
    after = {m["name"]: m["pid"] for m in httpx.get(d.url + "/llmd/status").json()["loaded"]}[QWEN]
    assert after == pid  # the same worker throughout: no reload for any of them
