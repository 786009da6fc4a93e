"""/metrics, the history route, the dashboard in a real headless browser, and `llmd bench`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ARTIFACTS, Daemon
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def obs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("obs") / "home", env={"LLMD_SLOTS": "2", "LLMD_CTX": "1024"}).start()
    yield d
    d.stop()


def scrape(d: Daemon) -> dict[str, dict[tuple, float]]:
    r = httpx.get(d.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(m: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    return sum(v for k, v in m.get(name, {}).items() if all((lk, lv) in k for lk, lv in labels.items()))


def test_metrics_count_the_requests_made(obs: Daemon):
    before = scrape(obs)
    for i in range(3):
        r = httpx.post(obs.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
    r = httpx.post(obs.url + "/api/generate", timeout=120, json={
        "model": "smollm2-135m", "prompt": "Hi", "stream": False, "options": {"num_predict": 5, "temperature": 0}})
    assert r.status_code == 200
    bad = httpx.post(obs.url + "/v1/chat/completions", json={"messages": "bad"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    after = scrape(obs)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("llmd_time_to_first_token_seconds_count", api="openai") == 3
    assert delta("llmd_time_to_first_token_seconds_count", api="ollama") == 1
    assert delta("llmd_request_duration_seconds_count") == 4
    assert delta("llmd_queue_wait_seconds_count") == 4
    assert delta("llmd_inter_token_latency_seconds_count") >= 4 * 3
    assert delta("llmd_requests_total", outcome="ok") == 4
    # a body error stops before any model is known: it counts nowhere, and nothing else moved
    assert delta("llmd_requests_total", outcome="rejected") == 0
    assert delta("llmd_requests_total") == 4
    assert delta("llmd_generated_tokens_total", model="smollm2-135m") >= 4
    assert delta("llmd_prompt_tokens_total") > 0
    assert delta("llmd_response_cache_total", result="miss") == 4
    # buckets fit a desktop: TTFT from 5 ms to 30 s
    les = {dict(k)["le"] for k in after["llmd_time_to_first_token_seconds_bucket"]}
    assert {"0.005", "30.0", "+Inf"} <= les
    for name in ("llmd_slots_busy", "llmd_requests_waiting", "llmd_models_loaded", "llmd_process_resident_memory_bytes",
                 "llmd_prefix_cache_hits_total", "llmd_accepted_tokens_total"):
        assert name in after, name
    assert total(after, "llmd_models_loaded") == 1


def test_history_has_points(obs: Daemon):
    httpx.post(obs.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pts = httpx.get(obs.url + "/llmd/history").json()["points"]
        if any(p["ttft_p50"] is not None for p in pts):
            break
        time.sleep(0.5)
    assert any(p["ttft_p50"] is not None and p["tokens_per_s"] for p in pts), pts[-3:]


@pytest.mark.skipif(not CHROMIUM and not os.environ.get("CI"), reason="chromium is not installed (CI installs it)")
def test_dashboard_in_a_real_browser(obs: Daemon):
    from playwright.sync_api import sync_playwright

    for i in range(3):
        httpx.post(obs.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": f"Tell me a fact number {i}."}], "max_tokens": 10,
            "temperature": 0, "seed": i})
    httpx.post(obs.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Tell me a fact number 0."}], "max_tokens": 10, "temperature": 0,
        "seed": 0})  # a response-cache hit
    time.sleep(2.5)
    errors: list[str] = []
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(obs.url + "/")
        page.wait_for_function("document.getElementById('ttft').dataset.points !== '0'", timeout=15000)
        page.wait_for_function("document.getElementById('models').rows.length > 1", timeout=15000)
        for chart in ("ttft", "tps", "cache", "slots"):
            assert int(page.get_attribute(f"#{chart}", "data-points") or 0) > 0, chart
        assert "smollm2-135m" in page.inner_text("#models")
        page.wait_for_function("document.getElementById('apps').rows.length > 1", timeout=15000)
        assert "smollm2-135m" in page.inner_text("#apps")  # the app that sent the requests (python-httpx)
        assert "llama.cpp" in page.inner_text("#backend")
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        browser.close()
    assert errors == []
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_llmd_bench_agrees_with_metrics(obs: Daemon, tmp_path: Path):
    before = scrape(obs)
    r = subprocess.run([sys.executable, "-m", "llmd", "bench", "--concurrency", "2", "--requests", "6",
                        "--max-tokens", "8", "--mix", "chat", "--json"],
                       env=obs.env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    after = scrape(obs)
    assert report["requests"] == 6 and report["errors"] == 0
    assert report["ttft_s"]["p50"] > 0 and report["ttft_s"]["p95"] >= report["ttft_s"]["p50"]
    assert report["tokens_per_s"] > 0
    gen = total(after, "llmd_generated_tokens_total") - total(before, "llmd_generated_tokens_total")
    assert report["generated_tokens"] == gen
    n = total(after, "llmd_requests_total", outcome="ok") - total(before, "llmd_requests_total", outcome="ok")
    assert n == 6
    assert report["daemon"]["requests_ok"] == 6


def test_structured_logs_have_request_ids_and_no_prompts(obs: Daemon):
    secret = "purple-elephant-7431"
    r = httpx.post(obs.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": f"Repeat {secret}"}], "max_tokens": 4, "temperature": 0,
        "seed": 99})
    assert r.status_code == 200
    rid = r.json()["id"].removeprefix("chatcmpl-")
    mine = obs.requests_logged(rid, wait=5)
    log = obs.home / "logs" / "llmd.log"
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert mine and mine[0]["outcome"] == "ok" and mine[0]["api"] == "openai" and mine[0]["completion_tokens"] >= 1
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in entries)
    assert secret not in log.read_text()


def test_a_cancelled_request_logs_how_far_its_reply_had_run(obs: Daemon):
    """A reply the client hung up on has no usage; its log line still says how much text went out
    (CI met an agent's reply that ran on for 685 s as a hang, with nothing in the log to tell)."""
    body = {"messages": [{"role": "user", "content": "Count from 1 to 500, one number per line."}],
            "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", obs.url + "/v1/chat/completions", json=body, timeout=120) as r:
        rid, sent = "", 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"].removeprefix("chatcmpl-")
            if any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                sent += 1
                if sent == 12:
                    break
    mine = obs.requests_logged(rid, wait=10)
    assert mine and mine[0]["outcome"] == "cancelled" and mine[0]["completion_tokens"] is None, mine
    assert mine[0]["streamed_pieces"] >= 12, mine
    # and the engine's own line: how far the prompt had been read and how much was generated
    cut = re.compile(rf"request {rid} cancelled after [\d.]+ s: prompt at (\d+) of (\d+) tokens "
                     rf"\((\d+) from cache\), (\d+) generated")
    deadline, said = time.monotonic() + 10, []
    while not said and time.monotonic() < deadline:
        lines = (obs.home / "logs" / "llmd.log").read_text().splitlines()
        said = [m for line in lines if line.strip() and (m := cut.search(json.loads(line)["msg"]))]
        time.sleep(0.2)
    assert said and said[0][1] == said[0][2] and int(said[0][4]) >= 12, said


def test_requests_running_counts_a_stream_in_flight(obs: Daemon):
    assert total(scrape(obs), "llmd_requests_running") == 0
    body = {"messages": [{"role": "user", "content": "Count from 1 to 200."}], "max_tokens": 150, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", obs.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(lines)  # admitted and streaming
        running = total(scrape(obs), "llmd_requests_running")
        for _ in lines:
            pass
    assert running == 1
    assert total(scrape(obs), "llmd_requests_running") == 0


def test_each_request_is_attributed_to_the_app_that_sent_it(obs: Daemon):
    """Two apps (their User-Agents, and one configured with an API key of its own) on one model:
    /llmd/status names each with its requests and engine time; the key itself is never shown."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 3, "temperature": 0}
    sent = [({"User-Agent": "Continue/1.2.3 (vscode)"}, 2), ({"User-Agent": "open-webui/0.6"}, 1),
            ({"User-Agent": "aider/0.80", "Authorization": "Bearer sk-my-own-key"}, 1)]
    for headers, n in sent:
        for i in range(n):
            r = httpx.post(obs.url + "/v1/chat/completions", headers={**headers, "Cache-Control": "no-store"},
                           json={**body, "seed": i}, timeout=120)
            assert r.status_code == 200, r.text
    apps = {a["app"]: a for a in httpx.get(obs.url + "/llmd/status").json()["apps"]}
    assert apps["Continue"]["requests"] >= 2 and apps["open-webui"]["requests"] >= 1, apps
    keyed = [a for name, a in apps.items() if name.startswith("key:")]
    assert keyed and "sk-my-own-key" not in json.dumps(apps), apps
    assert all(a["engine_s"] > 0 and a["model"] for a in (apps["Continue"], apps["open-webui"]))
