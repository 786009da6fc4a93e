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
from collections.abc import Callable, Iterator

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


@pytest.mark.parametrize("route", ["/infill", "/api/generate", "/v1/completions"])
def test_a_cursor_inside_a_word_or_after_the_indentation_is_completed_from_there(d: Daemon, route: str):
    """The cursor's line goes last in llmd's FIM prompt, less its last token, and the first token
    decoded must begin with that token's text (token healing): the completion neither repeats
    what was typed nor splits a word where the model never saw it split."""
    body, r = fill(d, route, "def add(a: int, b: int) -> int:\n    ret", "\n")
    assert r.status_code == 200 and body.startswith("urn") and "a + b" in body, (body, r.text)
    body, r = fill(d, route, "def add(a: int, b: int) -> int:\n    ", "\n")
    assert r.status_code == 200 and body.startswith("return") and "a + b" in body, (body, r.text)


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


def test_a_new_line_typed_keeps_the_suffix_computed(d: Daemon):
    """What was typed since a slot's last prompt goes after the middle token (chat.fim.middle_start),
    so a new line typed above a long suffix computes only its own tokens: the suffix's KV is kept.
    With the typed code at the prefix's end instead, all of the suffix would be computed again."""
    suffix = "\n" + "".join(f"    check_{i}(values)\n" for i in range(14)) + "    return values\n"
    prefix = "def tidy(values: list[int]) -> list[int]:\n    values = sorted(values)\n    "
    _, first = fill(d, "/infill", prefix, suffix, n_predict=4)
    assert first.status_code == 200 and first.json()["timings"]["prompt_n"] > 100, first.text
    for typed in ("zebra_count = 7\n    ", "zebra_count = 7\n    walrus = zebra_count * 3\n    "):
        # lines the model did not propose (so the proposal cannot answer them)
        _, r = fill(d, "/infill", prefix + typed, suffix, n_predict=4)
        body = r.json()
        assert r.status_code == 200 and r.headers.get("X-LLMD-Cache") != "hit", r.text
        assert body["timings"]["prompt_n"] < 30 and body["tokens_cached"] > 100, body["timings"]


def test_a_window_slid_down_a_line_moves_its_kv_whichever_slot_is_emptier(tmp_path):
    """An editor sends the 48 lines before the cursor: at a new line its window slides, the prompt
    shares only its first token with the last, and the slot that holds the old window serves it by
    moving the lines it kept (llama-server's --cache-reuse). Here no snapshot of the window is
    saved (as while other models keep the CPU busy: snapshots are idle work): by the common prefix
    alone the slot was worth less than an empty one, and the whole window was read again."""
    d = start_with_models(tmp_path / "home", {"LLMD_MODEL": QWEN, "LLMD_SLOTS": "2",
                                              "LLMD_PREFIX_MIN_TOKENS": "100000"}, (QWEN,))
    try:
        lines = [f"total_{i} = weigh(batch_{i}, scale={i * 7 % 13})\n" for i in range(49)]
        suffix = "\n\nprint(total_0)\n"
        _, first = fill(d, "/infill", "".join(lines[:48]), suffix, n_predict=2)
        assert first.status_code == 200 and first.json()["timings"]["prompt_n"] > 400, first.text
        _, slid = fill(d, "/infill", "".join(lines[1:49]), suffix, n_predict=2)
        body = slid.json()
        assert slid.status_code == 200 and slid.headers.get("X-LLMD-Cache") != "hit", slid.text
        assert body["tokens_cached"] > 400 and body["timings"]["prompt_n"] < 60, body["timings"]
    finally:
        d.stop()


def _send_and_drop(d: Daemon, body: dict[str, object], after: Callable[[], None] = lambda: None) -> None:
    """A request sent as an editor sends it and dropped as the next keystroke drops it (the
    connection closes once `after` returns)."""
    import json

    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", d.port))
    agent = f"python-httpx/{httpx.__version__}".encode()  # the same client as fill()'s requests
    s.sendall(b"POST /infill HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: " + agent
              + b"\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    after()
    s.close()


def _open_requests(d: Daemon) -> int:
    st = httpx.get(d.url + "/llmd/status", timeout=30).json()
    return sum(m["open_requests"] for m in st["loaded"])


def test_a_cancelled_request_frees_its_slot_at_once(d: Daemon):
    """An editor drops its request at the next keystroke: what it asked for runs on only a moment
    for the next keystroke (suggestions.ORPHAN_S), and a request it cannot serve stops it at once."""
    long = {"model": QWEN, "input_prefix": "# a very long list of prime numbers\nprimes = [", "input_suffix": "",
            "n_predict": 2000, "temperature": 0}

    def decoding() -> None:
        deadline = time.monotonic() + 60
        while _open_requests(d) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # decoding now

    _send_and_drop(d, long, decoding)
    t0 = time.monotonic()
    while _open_requests(d) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    gone = time.monotonic() - t0
    # 2,000 tokens would take minutes here: it ran on for the next keystroke only, then ended
    assert _open_requests(d) == 0 and gone < 10, gone
    # dropped again, and this time another place is asked for at once: that request cancels it
    before = httpx.get(d.url + "/llmd/status", timeout=30).json()["fim_proposals"]
    assert before["ran_on"] >= 1 and before["expired"] >= 1
    _send_and_drop(d, long, decoding)
    done, r = fill(d, "/infill", PREFIX, SUFFIX)  # answered by the response cache: no engine work of its own
    assert r.status_code == 200 and done
    after = httpx.get(d.url + "/llmd/status", timeout=30).json()["fim_proposals"]
    # stopped for it, not left to run on until suggestions.ORPHAN_S
    assert after["cancelled"] == before["cancelled"] + 1 and after["expired"] == before["expired"], after


def test_a_dropped_completion_serves_the_next_keystroke(d: Daemon):
    """Dropped while its prompt is still being read (an editor's next keystroke on two cores), the
    completion runs on, and the request of the keystroke that types its start is answered from it."""
    prefix = "def area(radius: float) -> float:\n    "
    first, r = fill(d, "/infill", prefix, "\n", top_k=40)  # what the model proposes there (greedy)
    assert r.status_code == 200 and len(first) > 4, first
    # the same request under other settings (another entry), dropped at once
    _send_and_drop(d, {"model": QWEN, "input_prefix": prefix, "input_suffix": "\n", "n_predict": 64,
                       "temperature": 0, "n_indent": 4, "top_k": 41})
    rest, again = fill(d, "/infill", prefix + first[:3], "\n", top_k=41)
    # the rest of it (to the end of a complete line, when it is still being decoded)
    assert again.headers["X-LLMD-Cache"] == "hit" and rest.strip() and first[3:].startswith(rest), (first, rest)


def test_a_completion_is_decoded_on_past_its_reply_for_the_next_keystrokes(d: Daemon):
    """The client gets n_predict tokens; the engine decodes on in the same slot, and typing all of
    the reply is answered from what followed it, with no model step."""
    prefix = "def squares(n: int) -> list[int]:\n    "
    first, r = fill(d, "/infill", prefix, "\n", n_predict=6)
    assert r.status_code == 200 and r.json()["timings"]["predicted_n"] == 6, r.json()
    deadline = time.monotonic() + 60
    while _open_requests(d) and time.monotonic() < deadline:  # the proposal decoding on
        time.sleep(0.05)
    rest, again = fill(d, "/infill", prefix + first, "\n", n_predict=6)
    assert again.headers["X-LLMD-Cache"] == "hit" and rest.strip(), (first, rest)


def test_an_editors_completion_goes_ahead_of_another_apps_long_prompt(d: Daemon):
    """A chat's ~1,600-token prompt is being read when a completion comes: the completion's prompt
    is read first (oldest first, it would wait for the chat's whole prompt) and it is answered
    before the chat's first token."""
    import threading
    import uuid

    words = " ".join(f"item{i}" for i in range(1000))
    chat: dict[str, float] = {}

    def long_chat() -> None:
        r = httpx.post(d.url + "/v1/chat/completions", timeout=600, headers={"Cache-Control": "no-store"},
                       json={"model": QWEN, "max_tokens": 1, "messages": [
                           {"role": "user", "content": f"{uuid.uuid4().hex} Count these: {words}"}]})
        assert r.status_code == 200, r.text
        chat["done"] = time.monotonic()

    t = threading.Thread(target=long_chat)
    t.start()
    deadline = time.monotonic() + 60
    while _open_requests(d) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # its prompt is being read
    body, r = fill(d, "/infill", f"# {uuid.uuid4().hex}\ndef double(x: int) -> int:\n    ", "\n", n_predict=2)
    answered = time.monotonic()
    t.join()
    assert r.status_code == 200 and body, r.text
    assert answered < chat["done"], (answered, chat["done"])


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


def test_an_editor_that_drops_its_requests_quickly_is_answered_before_it_does(d: Daemon):
    """The next keystroke drops a completion; llmd learns how long this editor's requests live and
    answers a little before that with what the model has, decoding on for the keystrokes that
    follow (typing the answer is then answered from what came after it). Last of this module's
    completion tests: from here on the daemon answers the 1.5B's completions early."""
    long = {"model": QWEN, "input_suffix": "", "n_predict": 200, "temperature": 0}
    for i in range(4):  # each one dropped 0.4 s after it was sent (unlike prompts: none serves the next)
        _send_and_drop(d, {**long, "input_prefix": f"# primes below {1000 * (i + 1)}\nprimes = ["},
                       lambda: time.sleep(0.4))
    within = next(iter(httpx.get(d.url + "/llmd/status", timeout=30).json()["fim_reply_within_s"][QWEN].values()))
    assert 0.2 < within < 0.4, within  # a share of how long they lived
    prefix = "# the first fifty squares\nsquares = ["
    first, r = fill(d, "/infill", prefix, "", n_predict=200)
    body = r.json()
    # cut by time, not by the model's end (without the cut the model ends this list itself, well
    # short of 200 tokens): what came in the first ~0.3 s
    assert r.status_code == 200 and first and body["stop_type"] == "limit", body
    assert body["timings"]["predicted_n"] < 60, body
    deadline = time.monotonic() + 60
    while _open_requests(d) and time.monotonic() < deadline:  # the proposal decoding on
        time.sleep(0.05)
    rest, again = fill(d, "/infill", prefix + first, "", n_predict=200)
    assert again.headers["X-LLMD-Cache"] == "hit" and rest, (first, rest)
    # learned of this editor only: another client (its own User-Agent) that never hung up gets the
    # whole completion, and the reply cut by time was never stored as the request's answer
    other = httpx.post(d.url + "/infill", timeout=600, headers={"User-Agent": "another-client/1.0"}, json={
        "model": QWEN, "input_prefix": prefix, "input_suffix": "", "n_predict": 200, "temperature": 0, "n_indent": 4})
    assert other.status_code == 200 and other.headers["X-LLMD-Cache"] != "hit", other.headers
    assert other.json()["timings"]["predicted_n"] > body["timings"]["predicted_n"], (other.json(), body)
