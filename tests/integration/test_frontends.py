"""The front ends people point at a local server, driven as their users do, against a real daemon
with llmd's defaults and the real Qwen2.5-Coder-1.5B: Codex CLI (`exec --oss`, and with llmd as a
provider in config.toml), opencode (`run`, llmd as an OpenAI-compatible provider) and aider
(`--message`, the OpenAI and the Ollama provider). Each app talks to llmd through a recording
proxy (tests/recorder.py): the test lists the routes it used and asserts none answered 4xx/5xx.

The apps come from scripts/install-frontends.sh (pinned; .ci/run installs them). Codex's and
opencode's own prompts are 8.6k and 7.2k tokens: the first cold prefill of each takes about three
minutes on two cores (llama.cpp's own speed there; a later run reuses the prefix).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ARTIFACTS, Daemon, start_with_models
from recorder import Recorder, summary

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::ResourceWarning")]

QWEN = "qwen2.5-coder-1.5b"
ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "tests" / "frontends" / "node_modules" / ".bin"
AIDER = Path.home() / ".cache" / "llmd" / "apps" / "aider-0.86.2" / "bin" / "aider"
TASK = "Create a file named hello.txt that contains the word hi."


def needs(path: Path) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not path.exists() and not os.environ.get("CI"),
                              reason=f"{path} is not installed: bash scripts/install-frontends.sh")


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # llmd's defaults (auto context, auto speculation with the 0.5B paired automatically)
    daemon = start_with_models(tmp_path_factory.mktemp("frontends") / "home", {"LLMD_MODEL": QWEN},
                               (QWEN, "qwen2.5-coder-0.5b"))
    yield daemon
    daemon.stop()
    gc.collect()


@pytest.fixture
def rec(d: Daemon) -> Iterator[Recorder]:
    with Recorder(d.url) as r:
        yield r


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    # PWD too: opencode takes its project folder from it, and the test's own would be inherited
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, "PWD": str(cwd), **env}, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_clean(r: subprocess.CompletedProcess, rec: Recorder, must_call: str, app: str = "") -> None:
    if app:  # which routes each app used, for the record (artifacts/frontends.jsonl)
        ARTIFACTS.mkdir(exist_ok=True)
        with (ARTIFACTS / "frontends.jsonl").open("a") as f:
            f.write(json.dumps({"app": app, "exit": r.returncode, **summary(rec), "calls": len(rec.calls)}) + "\n")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:], summary(rec))
    assert not rec.failed(), summary(rec)
    assert any(must_call in route for route in rec.routes()), summary(rec)


@needs(BIN / "codex")
def test_codex_exec_oss_and_as_a_configured_provider(rec: Recorder, tmp_path: Path):
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    base = [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    # --oss: Codex's Ollama mode (it reads /api/version and needs 0.13.4 or newer, then /v1/responses)
    r = run([*base, "--oss", "--local-provider", "ollama", "-m", QWEN, TASK], work,
            {"CODEX_HOME": str(home), "CODEX_OSS_BASE_URL": rec.url + "/v1"})
    assert_clean(r, rec, "POST /v1/responses", "codex --oss")
    # a provider in config.toml, as Codex's docs show for any Responses-API server; its tools
    # (function, namespace, custom and the hosted web_search) all reach llmd
    (home / "config.toml").write_text(
        f'model = "{QWEN}"\nmodel_provider = "llmd"\n\n[model_providers.llmd]\nname = "llmd"\n'
        f'base_url = "{rec.url}/v1"\nwire_api = "responses"\n')
    n = len(rec.calls)
    r = run(base + [TASK], work, {"CODEX_HOME": str(home)})
    assert_clean(r, rec, "POST /v1/responses", "codex (both runs)")
    assert len(rec.calls) > n


@needs(BIN / "opencode")
def test_opencode_run(rec: Recorder, tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "opencode.json").write_text(
        '{"$schema": "https://opencode.ai/config.json", "autoupdate": false, "model": "llmd/' + QWEN + '",\n'
        ' "provider": {"llmd": {"npm": "@ai-sdk/openai-compatible", "name": "llmd",\n'
        '   "options": {"baseURL": "' + rec.url + '/v1"}, "models": {"' + QWEN + '": {"name": "Qwen2.5-Coder"}}}}}\n')
    cache = Path.home() / ".cache" / "llmd" / "apps" / "opencode-cache"  # its AI SDK provider, installed once
    r = run([str(BIN / "opencode"), "run", TASK], work,
            {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(cache), "OPENCODE_DISABLE_AUTOUPDATE": "1"})
    assert_clean(r, rec, "POST /v1/chat/completions", "opencode")


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
    assert '"@openai/codex": "0.171.0"' in pkg and '"opencode-ai": "1.18.33"' in pkg
    assert "aider-0.86.2" in str(AIDER) and "AIDER_VERSION=0.86.2" in (ROOT / "scripts" / "install-frontends.sh").read_text()
