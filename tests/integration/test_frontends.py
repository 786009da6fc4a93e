"""The front ends people point at a local server, driven as their users do, against a real daemon
with llmd's defaults and the real Qwen2.5-Coder-1.5B: Open WebUI in a real browser (playwright and
Debian's chromium), Claude Code (`-p`, with its Write and Read tools), Codex CLI (`exec --oss`, and with llmd as a provider in config.toml), opencode
(`run`, llmd as an OpenAI-compatible provider) and aider (`--message`, the OpenAI and the Ollama
provider). Each app talks to llmd through a recording proxy (tests/recorder.py): the test lists
the routes it used and asserts none answered 4xx/5xx.

The apps come from scripts/install-frontends.sh (pinned; .ci/run installs them). Codex's and
opencode's own prompts are 8.6k and 7.2k tokens: the first cold prefill of each takes about three
minutes on two cores (llama.cpp's own speed there; a later run reuses the prefix).
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from conftest import ARTIFACTS, Daemon, start_with_models
from recorder import Recorder, summary

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::ResourceWarning")]

QWEN = "qwen2.5-coder-1.5b"
ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "tests" / "frontends" / "node_modules" / ".bin"
AIDER = Path.home() / ".cache" / "llmd" / "apps" / "aider-0.86.2" / "bin" / "aider"
OPEN_WEBUI = Path.home() / ".cache" / "llmd" / "apps" / "open-webui-0.12.4" / "bin" / "open-webui"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TASK = "Create a file named hello.txt that contains the word hi."
WARM_TRY_S = 300  # a warm try takes 5-65 s here; its prompt is cached


def needs(path: Path) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not path.exists() and not os.environ.get("CI"),
                              reason=f"{path} is not installed: bash scripts/install-frontends.sh")


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # llmd's defaults (auto context, auto speculation with the 0.5B paired automatically)
    daemon = start_with_models(tmp_path_factory.mktemp("frontends") / "home", {"LLMD_MODEL": QWEN},
                               (QWEN, "qwen2.5-coder-0.5b", "nomic-embed-text"))
    yield daemon
    daemon.stop()
    gc.collect()


@pytest.fixture
def rec(d: Daemon) -> Iterator[Recorder]:
    with Recorder(d.url) as r:
        yield r


TIMED_OUT = 124  # run()'s exit status for an app stopped at its time limit, as timeout(1) gives
# the engine's line for a request its client cut: how far its prompt had been read
CUT_READING = re.compile(r"cancelled after ([\d.]+) s: prompt at (\d+) of (\d+) tokens \((\d+) from cache\)")
READ_AT_SPEED = 10.0  # prompt tokens a second: two cores read the 1.5B's prompts at 60-130


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    """The app's run; past `timeout` its whole process group is killed (its connections to llmd
    close, which cancels what it asked) and the run ends with TIMED_OUT."""
    # PWD too: opencode takes its project folder from it, and the test's own would be inherited
    p = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "PWD": str(cwd), **env}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        return subprocess.CompletedProcess(cmd, TIMED_OUT, out, err + f"\n[killed after {timeout:.0f} s]")


def rambled(r: subprocess.CompletedProcess, d: Daemon, app: str, step: str, since: str) -> bool:
    """A try the app did not finish in its time: on a 1.5B model sampling at temperature ~1 (the
    apps' own setting) a reply now and then runs on for thousands of tokens towards the app's
    max_tokens of 32,000 (CI: an opencode reply decoded for 685 s at the usual step times). That is
    the model's choice like a missed tool call, so it counts as a try that did not do the task, but
    only if the reply cancelled by the kill was streaming (at least a piece a second), or its prompt
    was still being read at speed (the engine logs how far it got), or if the app had sent a prompt
    so much longer than a warm try's that the model's context grew for it (CI: the 1.5B called ToolSearch after a Write, and Claude Code then declared its eleven deferred
    tools in full, a 19,300-token prompt that two cores read in more than a try's time): a stalled
    engine still fails the test, as does a try that fails otherwise. `since`: the try's start (UTC
    ISO time, as the log writes it)."""
    if r.returncode != TIMED_OUT:
        return False
    deadline = time.monotonic() + 15  # the daemon notices the closed connection, then logs the request
    cut: list[dict] = []
    while not cut and time.monotonic() < deadline:
        cut = [e for e in d.requests_logged() if e["outcome"] == "cancelled" and e["ts"] >= since]
        time.sleep(0.2)
    log = [json.loads(x) for x in (d.home / "logs" / "llmd.log").read_text().splitlines() if x.strip()]
    grew = [e["msg"] for e in log if e.get("ts", "") >= since and "a prompt needed" in e.get("msg", "")]
    reading = [(float(m[1]), int(m[2]), int(m[3]), int(m[4])) for e in log if e.get("ts", "") >= since
               and (m := CUT_READING.search(e.get("msg", "")))]
    # the new long prompt still being read when the kill came (once read, its reply must stream)
    if cut and grew and any(at < total for _, at, total, _ in reading):
        timed(app, f"{step}: killed at its time limit while reading a new long prompt ({grew[-1]})", time.monotonic())
        return True
    if cut and reading and all(at < total and (at - cached) / max(s, 1.0) >= READ_AT_SPEED
                               for s, at, total, cached in reading):
        timed(app, f"{step}: killed at its time limit while reading a long prompt at speed ({reading[-1]})",
              time.monotonic())
        return True
    assert cut and all(e["streamed_pieces"] >= e["duration_s"] for e in cut), (app, step, "stalled, not rambling", cut)
    timed(app, f"{step}: killed at its time limit (the reply ran on: {cut[-1]['streamed_pieces']} pieces)",
          time.monotonic())
    return True


def utc_now() -> str:
    """Now as the request log writes its `ts` (comparable as text)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def assert_hello(work: Path, r: subprocess.CompletedProcess) -> None:
    """The task's file: hello.txt, holding the word hi."""
    made = work / "hello.txt"
    assert made.exists() and "hi" in made.read_text().lower(), (r.stdout[-2000:], sorted(os.listdir(work)))


def assert_clean(r: subprocess.CompletedProcess, rec: Recorder, must_call: str, app: str = "") -> None:
    if app:  # which routes each app used, for the record (artifacts/frontends.jsonl), and what it
        # sent (artifacts/recordings/: what benchmarks/agents.py replays)
        ARTIFACTS.mkdir(exist_ok=True)
        with (ARTIFACTS / "frontends.jsonl").open("a") as f:
            f.write(json.dumps({"app": app, "exit": r.returncode, **summary(rec), "calls": len(rec.calls)}) + "\n")
        slug = "".join(c if c.isalnum() else "-" for c in app).strip("-")
        rec.save(ARTIFACTS / "recordings" / f"{slug}-{time.strftime('%H%M%S')}.jsonl")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:], summary(rec))
    assert not rec.failed(), summary(rec)
    assert any(must_call in route for route in rec.routes()), summary(rec)


def claude_env(rec: Recorder, home: Path) -> dict[str, str]:
    """Claude Code pointed at a local server as its docs say (ANTHROPIC_BASE_URL, a token, a model),
    with a fresh HOME and nothing sent elsewhere (no updater, no telemetry)."""
    return {"HOME": str(home), "ANTHROPIC_BASE_URL": rec.url, "ANTHROPIC_AUTH_TOKEN": "llmd", "ANTHROPIC_MODEL": QWEN,
            "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}


def timed(app: str, step: str, t0: float) -> None:
    """Each front-end run's wall time, for the record (artifacts/frontends-timings.jsonl)."""
    ARTIFACTS.mkdir(exist_ok=True)
    with (ARTIFACTS / "frontends-timings.jsonl").open("a") as f:
        f.write(json.dumps({"app": app, "step": step, "wall_s": round(time.monotonic() - t0, 1)}) + "\n")


@needs(BIN / "claude")
@pytest.mark.timeout(3000)  # its cold ~12k-token prefill is 5-6 min here, then up to 25 warm runs
def test_claude_code_answers_writes_a_file_and_reads_one(d: Daemon, rec: Recorder, tmp_path: Path):
    """Claude Code unchanged on the 1.5B: a plain answer, a file written through its Write tool, and
    a file read through its Read tool and answered from (the tool result fed back). Its first
    request is ~12,000 tokens (system prompt and tools) whatever the task: the first run prefills
    it cold, the next ones find it cached."""
    home, work = tmp_path / "claude-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = claude_env(rec, home)
    claude = str(BIN / "claude")
    t0 = time.monotonic()
    r = run([claude, "-p", "Reply with just the word hello"], work, env, timeout=1200)
    timed("claude", "hello (session 1: cold)", t0)
    assert_clean(r, rec, "POST /v1/messages", "claude -p")
    assert "hello" in r.stdout.lower(), (r.stdout[-2000:], r.stderr[-2000:])

    def attempts(prompt: str, tool: str, done: Callable[[subprocess.CompletedProcess, list[bytes]], bool],
                 step: str) -> None:
        """Claude Code samples at temperature 1 (its API's default; llmd cuts the tail as
        llama-server does): on a 1.5B model a Read call came in about half the runs measured (4 of 8
        on the recorded request, Intel Xeon), so a task gets up to twelve tries (0.5 ** 12); each
        must run clean, one must do it."""
        for i in range(12):
            t0, seen, since = time.monotonic(), len(rec.bodies), utc_now()
            r = run([claude, "-p", prompt, "--allowedTools", tool], work, env, timeout=WARM_TRY_S)
            timed("claude", f"{step} (try {i + 1})", t0)
            if rambled(r, d, "claude", step, since):
                continue
            assert_clean(r, rec, "POST /v1/messages", f"claude --allowedTools {tool}")
            if done(r, rec.bodies[seen:]):
                return
        raise AssertionError((step, r.stdout[-2000:], sorted(os.listdir(work))))

    made = work / "hello.py"
    attempts("Use the Write tool to create a file named hello.py that prints hello world.", "Write",
             lambda r, sent: made.exists() and "print" in made.read_text(), "write hello.py")
    (work / "notes.txt").write_text("Harbour notes.\nThe keeper's secret word is PELICAN.\n")

    def read_and_fed_back(r: subprocess.CompletedProcess, sent: list[bytes]) -> bool:
        """Read was called and its result, the file's text, went back to the model in the next
        request; whether the 1.5B then quotes the word is its own judgement (recorded, not required)."""
        fed = any(b'"tool_result"' in b and b"PELICAN" in b for b in sent)
        timed("claude", f"read: result fed back {fed}, answer names the word {'PELICAN' in r.stdout.upper()}",
              time.monotonic())
        return fed

    attempts("Use the Read tool to read notes.txt, then tell me the keeper's secret word.", "Read",
             read_and_fed_back, "read notes.txt and answer")


@needs(BIN / "codex")
@pytest.mark.timeout(3000)  # Codex's cold 8.6k-token prefill is about four minutes here, then warm tries
def test_codex_exec_oss_and_as_a_configured_provider(d: Daemon, rec: Recorder, tmp_path: Path):
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    base = [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    # --oss: Codex's Ollama mode (it reads /api/version and needs 0.13.4 or newer, then /v1/responses)
    oss = {"CODEX_HOME": str(home), "CODEX_OSS_BASE_URL": rec.url + "/v1"}
    codex_task(lambda limit: run([*base, "--oss", "--local-provider", "ollama", "-m", QWEN, TASK], work, oss, limit),
               d, rec, work, "codex --oss")
    (work / "hello.txt").unlink(missing_ok=True)
    # a provider in config.toml, as Codex's docs show for any Responses-API server; its tools
    # (function, namespace, custom and the hosted web_search) all reach llmd
    (home / "config.toml").write_text(
        f'model = "{QWEN}"\nmodel_provider = "llmd"\n\n[model_providers.llmd]\nname = "llmd"\n'
        f'base_url = "{rec.url}/v1"\nwire_api = "responses"\n')
    n = len(rec.calls)
    codex_task(lambda limit: run(base + [TASK], work, {"CODEX_HOME": str(home)}, limit), d, rec, work,
               "codex (configured provider)")
    assert len(rec.calls) > n


def codex_task(go: Callable[[float], subprocess.CompletedProcess], d: Daemon, rec: Recorder, work: Path,
               app: str) -> None:
    """The task, run clean. Whether hello.txt is written is recorded, not required: on the 1.5B,
    Codex's runs end cleanly but the model writes its call as text ("create_file" JSON in a code
    block) instead of calling Codex's shell or apply_patch tools (three tries in a row here). Codex
    sends a request again when its stream is idle for 300 s (its cold prompt's prefill takes longer
    on two cores): llmd's keep-alive events must prevent that. A try stopped at its time limit while
    the model rambled (rambled(): CI, a configured-provider run killed after 900 s with no request
    refused) is the model's choice and gets another, up to three; the first has room for the cold
    prompt, the next ones a warm try's time."""
    for i in range(3):
        t0, seen, since = time.monotonic(), len(rec.requests), utc_now()
        r = go(900 if i == 0 else WARM_TRY_S)
        made = work / "hello.txt"
        timed("codex", f"{app} (try {i + 1}): hello.txt written {made.exists() and 'hi' in made.read_text().lower()}", t0)
        if rambled(r, d, "codex", f"{app} (try {i + 1})", since):
            continue
        assert_clean(r, rec, "POST /v1/responses", app)
        sent = [body for method, path, body in rec.requests[seen:] if path.endswith("/responses")]
        assert len(set(sent)) == len(sent), f"Codex sent a request again ({len(sent)} sent, {len(set(sent))} different)"
        return
    raise AssertionError((app, "three tries, each stopped at its time limit while the model rambled",
                          r.stderr[-2000:], summary(rec)))


@needs(BIN / "opencode")
@pytest.mark.timeout(1800)  # its cold 7.2k-token prefill is about three minutes here, then warm tries
def test_opencode_run(d: Daemon, rec: Recorder, tmp_path: Path):
    """opencode's task writes hello.txt through its tools. Whether the 1.5B calls the tool is its
    own judgement (one CI run's only try ended cleanly with no file; a rerun wrote it at the third
    try), so the task gets up to twelve tries, about 12 s each once warm; each must run clean, one
    must write the file."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "opencode.json").write_text(
        '{"$schema": "https://opencode.ai/config.json", "autoupdate": false, "model": "llmd/' + QWEN + '",\n'
        ' "provider": {"llmd": {"npm": "@ai-sdk/openai-compatible", "name": "llmd",\n'
        '   "options": {"baseURL": "' + rec.url + '/v1"}, "models": {"' + QWEN + '": {"name": "Qwen2.5-Coder"}}}}}\n')
    cache = Path.home() / ".cache" / "llmd" / "apps" / "opencode-cache"  # its AI SDK provider, installed once
    made = work / "hello.txt"
    for i in range(12):
        t0, since = time.monotonic(), utc_now()
        r = run([str(BIN / "opencode"), "run", TASK], work,
                {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(cache), "OPENCODE_DISABLE_AUTOUPDATE": "1"},
                timeout=900 if i == 0 else WARM_TRY_S)
        timed("opencode", f"run (try {i + 1}{', cold' if i == 0 else ''})", t0)
        if rambled(r, d, "opencode", f"try {i + 1}", since):
            continue
        assert_clean(r, rec, "POST /v1/chat/completions", "opencode")
        if made.exists() and "hi" in made.read_text().lower():
            break
    assert_hello(work, r)


@needs(AIDER)
@pytest.mark.parametrize("provider", ["openai", "ollama"])
def test_aider_edits_a_file(rec: Recorder, tmp_path: Path, provider: str):
    src = tmp_path / "math_utils.py"
    src.write_text("def sub(a, b):\n    return a - b\n")
    env = ({"OPENAI_API_BASE": rec.url + "/v1", "OPENAI_API_KEY": "none"} if provider == "openai"
           else {"OLLAMA_API_BASE": rec.url})
    model = f"openai/{QWEN}" if provider == "openai" else f"ollama_chat/{QWEN}"
    r = run([str(AIDER), "--model", model, "--no-git", "--yes-always", "--no-show-model-warnings",
             "--no-check-update", "--analytics-disable", "--no-pretty",
             "--message", "Add a function add(a, b) that returns a + b.", str(src)], tmp_path,
            {**env, "HOME": str(tmp_path)})
    assert_clean(r, rec, "/v1/chat/completions" if provider == "openai" else "/api/chat", f"aider ({provider})")
    assert "def add(a, b)" in src.read_text() and "def sub" in src.read_text(), (src.read_text(), r.stdout[-2000:])


def test_the_apps_are_pinned():
    """What scripts/install-frontends.sh installs is what this file drives."""
    assert shutil.which("npm") is not None
    pkg = (ROOT / "tests" / "frontends" / "package.json").read_text()
    assert '"@anthropic-ai/claude-code": "2.1.332"' in pkg and '"@openai/codex": "0.171.0"' in pkg and '"opencode-ai": "1.18.33"' in pkg
    assert "aider-0.86.2" in str(AIDER) and "AIDER_VERSION=0.86.2" in (ROOT / "scripts" / "install-frontends.sh").read_text()


@pytest.fixture
def webui(rec: Recorder, tmp_path: Path) -> Iterator[str]:
    """Open WebUI as its docs run it against Ollama (OLLAMA_BASE_URL), its own settings otherwise:
    no login (WEBUI_AUTH=False), a temp DATA_DIR, documents embedded through Ollama's API with
    nomic-embed-text (its default embedder would be downloaded from the Hub, and nothing is)."""
    import httpx
    from conftest import free_port

    port = free_port()
    env = {**os.environ, "WEBUI_AUTH": "False", "DATA_DIR": str(tmp_path / "webui"), "OLLAMA_BASE_URL": rec.url,
           "ENABLE_OPENAI_API": "False", "RAG_EMBEDDING_ENGINE": "ollama", "RAG_EMBEDDING_MODEL": "nomic-embed-text",
           "RAG_OLLAMA_BASE_URL": rec.url, "OFFLINE_MODE": "True", "HF_HUB_OFFLINE": "1",
           "WEBUI_SECRET_KEY": "llmd-test", "ENABLE_VERSION_UPDATE_CHECK": "False", "HOME": str(tmp_path),
           "ANONYMIZED_TELEMETRY": "False", "DO_NOT_TRACK": "True", "SCARF_NO_ANALYTICS": "True"}
    (tmp_path / "webui").mkdir()
    log = (tmp_path / "webui.log").open("w")
    proc = subprocess.Popen([str(OPEN_WEBUI), "serve", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            assert proc.poll() is None, (tmp_path / "webui.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@needs(OPEN_WEBUI)
@pytest.mark.skipif(not CHROMIUM and not os.environ.get("CI"), reason="chromium is not installed (CI installs it)")
@pytest.mark.timeout(1500)  # 4.5 min here; its 6.6k-token cold prefill takes longer on a slower machine
def test_open_webui_in_a_browser(rec: Recorder, webui: str, tmp_path: Path):
    """As a user: pick the model, two turns, regenerate, stop a reply midway, attach a document and
    ask about it. Open WebUI's defaults include its built-in tools: the first prompt is ~6.6k tokens
    (its cold prefill is most of this test's time; the later turns reuse it)."""
    from playwright.sync_api import expect, sync_playwright

    doc = tmp_path / "harbour-notes.txt"
    doc.write_text("Harbour notes.\nThe keeper's secret word is PELICAN.\nThe lamp is lit at dusk.\n")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(30_000)
        page.goto(webui + "/", wait_until="load", timeout=120_000)
        page.get_by_text("Okay, Let's Go!").click()  # the release notes shown at a first visit
        page.click("#model-selector-model-button")
        page.click(f"button[aria-label='Select {QWEN}:latest model']")  # listed from /api/tags
        expect(page.locator("#model-selector-model-button")).to_contain_text(QWEN)
        replies = page.locator("#response-content-container")
        regenerate = page.locator("button[aria-label='Regenerate']")

        def ask(text: str, n: int, timeout: float = 600_000) -> str:
            """Send `text` and wait until the n-th reply is finished (its Regenerate button shows)."""
            page.click("#chat-input")
            page.keyboard.type(text)
            page.keyboard.press("Enter")
            expect(regenerate).to_have_count(n, timeout=timeout)
            return replies.nth(n - 1).inner_text()

        first = ask("Write a haiku about the sea.", 1, timeout=900_000)
        assert first.strip(), "the first reply is empty"
        second = ask("Now write one about mountains.", 2)
        assert second.strip() and second != first
        regenerate.last.click()  # a menu: try again, add details, more concise
        page.get_by_role("button", name="Try Again").click()  # a new reply to the same turn, shown as 2/2
        expect(page.get_by_text("2/2")).to_be_visible(timeout=300_000)
        expect(regenerate).to_have_count(2, timeout=300_000)
        assert replies.last.inner_text().strip()

        page.click("#chat-input")
        page.keyboard.type("Write a very long story about a lighthouse keeper and his cat.")
        page.keyboard.press("Enter")
        expect(replies).to_have_count(3, timeout=300_000)
        page.wait_for_function("() => { const r = document.querySelectorAll('#response-content-container');"
                               " return r.length >= 3 && r[2].innerText.length > 40; }", timeout=300_000)
        page.click("button[aria-label='Stop']")
        time.sleep(3)
        stopped = replies.nth(2).inner_text()
        time.sleep(3)
        assert replies.nth(2).inner_text() == stopped, "the reply kept growing after Stop"

        page.locator("input[type=file]:not(#camera-input)").set_input_files(str(doc))
        expect(page.get_by_text("harbour-notes.txt").first).to_be_visible()
        time.sleep(2)  # embedded through /api/embed before the question goes
        answer = ask("What is the keeper's secret word in the attached notes? Answer with the word only.", 4)
        browser.close()
    assert "PELICAN" in answer.upper(), answer
    routes = rec.routes()
    ARTIFACTS.mkdir(exist_ok=True)
    with (ARTIFACTS / "frontends.jsonl").open("a") as f:
        f.write(json.dumps({"app": "open-webui", **summary(rec), "calls": len(rec.calls)}) + "\n")
    assert not rec.failed(), summary(rec)
    for route in ("GET /api/tags", "POST /api/chat", "POST /api/embed"):
        assert route in routes, summary(rec)
