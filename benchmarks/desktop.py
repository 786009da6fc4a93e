"""The whole desktop at once (issue 48): an editor, a chat, an agent and an indexer, each with its own
model, on one machine, against llama-server run as people run several models with it (one process
per model, the same threads each, as llama-swap does), and against each workload alone on llmd.

- editor: a person types Python's textwrap.py with autocomplete on Qwen2.5-Coder 0.5B (the typing
  trace of benchmarks/autocomplete.py, /infill, each request dropped at the next keystroke);
- chat: a question to Qwen2.5-Coder 1.5B every CHAT_EVERY_S seconds, streamed (time to first token);
- agent: opencode's recorded session (benchmarks/data) replayed turn after turn on the 1.5B (its
  title request beside the first turn, as opencode sends it; turns counted without it);
- indexer: chunks of Python's json package embedded with nomic-embed-text, BATCH at a time.

The run lasts as long as the person types; the other workloads stop with it. Per workload: what
the editor saw in time and the characters it got right, the chat's first-token times, the agent's
turns completed, the embeddings per second; reloads (a model's worker replaced) and the resident
memory of all the system's processes at the end. Nothing else runs on the machine meanwhile.

    python benchmarks/desktop.py --dir ~/.cache/llmd/test-models [--words 60] [--systems all,llama-server,alone]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT, cpu_name, free_port, start_llmd_with, stop, wait_http  # noqa: E402
from agents import DATA, load, send  # noqa: E402
from autocomplete import Result, trace  # noqa: E402
from autocomplete import run as type_trace  # noqa: E402

CODER, CHAT, EMBED = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "nomic-embed-text"
FILES = {CODER: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", CHAT: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
         EMBED: "nomic-embed-text-v1.5.f16.gguf"}
CHAT_EVERY_S = 30.0
QUESTIONS = ["How do I reverse a list in Python?", "What does a Python generator do?",
             "Explain what a mutex is in two sentences.", "What is the difference between a tuple and a list?",
             "How do I read a file line by line in Python?", "What is a closure?",
             "When should I use a dataclass?", "What does git rebase do?"]
BATCH = 8
CHUNK = 1200  # characters per embedded chunk
RECORDING = "opencode-1.18.33-hello-session.jsonl"
SCHED_STATS = ("preemptions", "holds", "held_s", "yields_to_urgent", "turns", "held_back", "joins")  # /llmd/status, per model


@dataclass
class Outcome:
    editor: Result | None = None
    chat: list[float] = field(default_factory=list)
    agent_turns: int = 0
    embedded: int = 0
    seconds: float = 0.0
    reloads: int = 0
    rss: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds each model's process used in the run
    # per llmd model, how its work was ordered (preemptions, yields, turns, held back): for the why
    sched: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class Stop:
    def __init__(self) -> None:
        self.event = threading.Event()

    def wait(self, s: float) -> bool:
        return self.event.wait(s)


def chat_loop(url: str, stop_: Stop, out: Outcome) -> None:
    stop_.wait(10.0)
    i = 0
    while not stop_.event.is_set():
        body = {"model": CHAT, "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                "max_tokens": 48, "temperature": 0, "stream": True}
        try:
            ttft, _ = send(url, "/v1/chat/completions", body)
            out.chat.append(ttft)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out.errors.append(f"chat: {e}")
        i += 1
        stop_.wait(CHAT_EVERY_S)


def _titles(body: dict[str, Any]) -> bool:
    """opencode's session-title request: opencode sends it beside the first turn, not before it."""
    first = (body.get("messages") or [{}])[0]
    return first.get("role") == "system" and str(first.get("content", "")).startswith("You are a title generator")


def agent_loop(url: str, stop_: Stop, out: Outcome) -> None:
    """The recording's turns one after another, its title request beside the first, as opencode
    sends them; a turn counts when its reply is whole (the title is not a turn)."""
    turns = load(DATA / RECORDING, CHAT)

    def title(path: str, body: dict[str, Any]) -> None:
        try:
            send(url, path, body)
        except Exception as e:  # noqa: BLE001
            if not stop_.event.is_set():
                out.errors.append(f"agent's title: {e}")

    titling: threading.Thread | None = None
    while not stop_.event.is_set():
        for path, body in turns:
            if stop_.event.is_set():
                return
            if _titles(body):
                # one title at a time: a replayed session whose turns hit the cache starts again
                # within seconds, and its titles piled up (opencode runs one session here)
                if titling is None or not titling.is_alive():
                    titling = threading.Thread(target=title, args=(path, body), daemon=True)
                    titling.start()
                continue
            try:
                send(url, path, body)
                out.agent_turns += 1
            except Exception as e:  # noqa: BLE001
                out.errors.append(f"agent: {e}")
                stop_.wait(1.0)


def chunks() -> list[str]:
    import json as json_pkg

    out = []
    for f in sorted(Path(json_pkg.__file__).parent.glob("*.py")):
        text = f.read_text()
        out += [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)]
    return out


def indexer_loop(url: str, stop_: Stop, out: Outcome) -> None:
    todo = chunks()
    i = 0
    with httpx.Client(timeout=600) as c:
        while not stop_.event.is_set():
            batch = [todo[(i + j) % len(todo)] + f"\n# {i + j}" for j in range(BATCH)]  # never a cache hit
            r = c.post(url + "/v1/embeddings", json={"model": EMBED, "input": batch},
                       headers={"Cache-Control": "no-store"})
            if r.status_code != 200:
                out.errors.append(f"indexer: {r.status_code} {r.text[:200]}")
                stop_.wait(1.0)
                continue
            out.embedded += len(r.json()["data"])
            i += BATCH


def run(urls: dict[str, str], workloads: list[str], text: str, events: Any, end: int,
        watch: Any = None) -> Outcome:
    """Run the workloads at once; the editor's typing sets the length (or the first workload's
    own if the editor is not among them: then it runs for the typing's length)."""
    out = Outcome()
    stop_ = Stop()
    loops = {"chat": chat_loop, "agent": agent_loop, "indexer": indexer_loop}
    threads = [threading.Thread(target=loops[w], args=(urls[w], stop_, out), daemon=True)
               for w in workloads if w in loops]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    watcher = threading.Thread(target=watch, args=(stop_,), daemon=True) if watch else None
    if watcher:
        watcher.start()
    if "editor" in workloads:
        out.editor = type_trace(urls["editor"], "/infill", CODER, text, events, end)
    else:
        stop_.wait(typing_seconds(events))
    out.seconds = time.perf_counter() - t0
    stop_.event.set()
    for t in threads:
        t.join(5.0)  # a turn still in flight is not counted (its server stops next)
    return out


def typing_seconds(events: Any) -> float:
    from autocomplete import CPS

    total, cursor = 0.0, events[0].at - 1
    for ev in events:
        total += (ev.at - cursor) / CPS + ev.pause
        cursor = ev.at
    return total


def tree_rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            total += sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
        except psutil.Error:
            pass
    return total


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each named process has used so far."""
    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_used(before: dict[str, int], pids: dict[str, int], at_start: dict[str, float]) -> dict[str, float]:
    """CPU seconds each model's process used since `at_start` (a process that replaced one counts whole)."""
    now = cpu_seconds(pids)
    return {name: now[name] - (at_start.get(name, 0.0) if before.get(name) == pids[name] else 0.0)
            for name in now}


def llmd_run(models: dict[str, str], workloads: list[str], text: str, events: Any, end: int) -> Outcome:
    proc, url, _ = start_llmd_with(models)  # LLMD_MAX_LOADED and everything else: the defaults
    seen: dict[str, set[int]] = {}

    def watch(stop_: Stop) -> None:
        while not stop_.wait(1.0):
            try:
                for m in httpx.get(url + "/llmd/status", timeout=10).json()["loaded"]:
                    seen.setdefault(m["name"], set()).add(m["pid"])
            except httpx.HTTPError:
                pass

    def workers() -> dict[str, int]:
        return {m["name"]: m["pid"] for m in httpx.get(url + "/llmd/status", timeout=30).json()["loaded"]}

    try:
        warm(url, workloads, models)
        pids = workers()
        at_start = cpu_seconds(pids)
        out = run({w: url for w in ("editor", "chat", "agent", "indexer")}, workloads, text, events, end, watch)
        out.reloads = sum(len(p) - 1 for p in seen.values())
        out.rss = tree_rss([proc.pid])
        out.cpu = cpu_used(pids, workers(), at_start)
        out.sched = {m["name"]: {k: (m.get("stats") or {}).get(k, 0) for k in SCHED_STATS}
                     for m in httpx.get(url + "/llmd/status", timeout=30).json()["loaded"]}
        return out
    finally:
        stop(proc)


def warm(url: str, workloads: list[str], models: dict[str, str]) -> None:
    """Each model used once before the clock starts (a load is not what this measures)."""
    with httpx.Client(timeout=600) as c:
        if "editor" in workloads:
            c.post(url + "/infill", json={"model": CODER, "input_prefix": "def f():\n    ", "input_suffix": "\n",
                                          "n_predict": 2}).raise_for_status()
        if "chat" in workloads or "agent" in workloads:
            c.post(url + "/v1/chat/completions", json={"model": CHAT, "max_tokens": 1, "messages": [
                {"role": "user", "content": "Hi"}]}, headers={"Cache-Control": "no-store"}).raise_for_status()
        if "indexer" in workloads:
            c.post(url + "/v1/embeddings", json={"model": EMBED, "input": ["warm"]}).raise_for_status()


def llama_servers(models: dict[str, str], workloads: list[str], text: str, events: Any, end: int) -> Outcome:
    tool = ROOT.parent / "shared" / "tools" / "build-llama-server.sh"
    if not tool.exists():
        tool = ROOT / "scripts" / "build-llama-server.sh"
    bin_dir = Path(subprocess.run(["bash", str(tool)], capture_output=True, text=True, check=True).stdout.strip())
    amx = ["--no-repack"] if "amx_tile" in Path("/proc/cpuinfo").read_text() else []
    threads = str(psutil.cpu_count(logical=False) or 2)
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    extra = {CODER: ["-ub", "1024", "-b", "1024", "--cache-reuse", "256"],  # llama.vscode's settings
             CHAT: ["-np", "4", "-c", "65536", "--cache-reuse", "256"], EMBED: ["--embedding", "-ub", "2048", "-b", "2048"]}
    try:
        for name in (CODER, CHAT, EMBED):
            port = free_port()
            p = subprocess.Popen([str(bin_dir / "llama-server"), "-m", models[name], "-t", threads, "--port", str(port),
                                  "--host", "127.0.0.1", "--alias", name, *extra[name], *amx],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            url = f"http://127.0.0.1:{port}"
            procs[name] = (p, url)
            wait_http(url + "/health", p, timeout=300)
            while httpx.get(url + "/health", timeout=5).status_code != 200:
                time.sleep(0.2)
        urls = {"editor": procs[CODER][1], "chat": procs[CHAT][1], "agent": procs[CHAT][1], "indexer": procs[EMBED][1]}
        for w in workloads:
            warm(urls[w], [w], models)
        pids = {name: p.pid for name, (p, _) in procs.items()}
        at_start = cpu_seconds(pids)
        out = run(urls, workloads, text, events, end)
        out.rss = tree_rss([p.pid for p, _ in procs.values()])
        out.cpu = cpu_used(pids, pids, at_start)
        return out
    finally:
        for p, _ in procs.values():
            stop(p)


def pct(xs: list[float], q: float) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    return f"{s[min(len(s) - 1, int(q * len(s)))]:.2f}"


def row(name: str, o: Outcome) -> str:
    e = o.editor
    editor = (f"{len(e.latencies)}/{e.sent}, {len(e.covered)} chars ({len(e.covered) / max(1, e.typed):.0%})"
              if e else "-")
    return (f"| {name} | {editor} | {pct(o.chat, 0.5)} / {pct(o.chat, 0.9)} ({len(o.chat)}) | {o.agent_turns} "
            f"| {o.embedded / o.seconds:.1f} | {o.reloads} | {o.rss / 2**30:.2f} | {len(o.errors)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/llmd/test-models",
                    help="where the three GGUFs are (scripts/fetch_models.py puts them there)")
    ap.add_argument("--words", type=int, default=60, help="word ends the person pauses at (sets the run's length)")
    ap.add_argument("--systems", default="all,llama-server,alone",
                    help="comma-separated: all, llama-server, alone (each workload alone), or one "
                         "workload alone as editor-alone, chat-alone, agent-alone, indexer-alone")
    args = ap.parse_args()
    models = {name: str(args.dir / f) for name, f in FILES.items()}
    text = Path(textwrap.__file__).read_text()
    events, end = trace(text, 120, args.words)
    everything = ["editor", "chat", "agent", "indexer"]
    print(f"# desktop: editor ({CODER}, {len(events)} word ends), chat ({CHAT}, every {CHAT_EVERY_S:g} s), agent "
          f"({RECORDING} on {CHAT}), indexer ({EMBED}, {BATCH} chunks a request); {cpu_name()}, {os.cpu_count()} CPUs\n")
    print("| run | editor: shown in time, characters accepted | chat first token p50 / p90 s (n) | agent turns "
          "| embeddings/s | reloads | resident GiB | errors |\n|---|---|---|---|---|---|---|---|", flush=True)
    errors: list[str] = []
    cpu: list[str] = []
    systems = args.systems.split(",")

    def report(name: str, o: Outcome) -> None:
        print(row(name, o), flush=True)
        errors.extend(o.errors)
        cpu.append(f"{name}: " + ", ".join(f"{m} {s:.0f} s" for m, s in sorted(o.cpu.items(), key=lambda x: -x[1]))
                   + f" of {o.seconds * (os.cpu_count() or 1):.0f} CPU-seconds"
                   + "".join(f"; {m} {st}" for m, st in o.sched.items()))

    if "all" in systems:
        report("llmd, all four at once", llmd_run(models, everything, text, events, end))
    if "llama-server" in systems:
        report("llama-server x3, all four at once", llama_servers(models, everything, text, events, end))
    for w in everything:
        if "alone" in systems or f"{w}-alone" in systems:
            report(f"llmd, {w} alone", llmd_run(models, [w], text, events, end))
    print("\nCPU seconds each model's process used during the run (the chat and the agent share the 1.5B's):")
    for line in cpu:
        print(f"- {line}")
    for e in errors[:10]:
        print(f"error: {e}")
    print(json.dumps({"seconds_typed": round(typing_seconds(events), 1)}))


if __name__ == "__main__":
    main()
