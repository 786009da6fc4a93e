"""Editor autocomplete as a person types: llmd's three FIM routes against llama-server's /infill.

A person types a real source file no one here wrote (Python's own textwrap.py, from line 120) at
6 characters a second, pausing briefly at each word end and longer at each line end. At every
pause the editor sends a fill-in-the-middle request, as llama.vscode does (the 48 lines before
the cursor, the cursor's line, the 16 lines after the code being written, n_predict 24), and drops
it at the next keystroke (the connection closes). A completion is *shown* when it arrives before
the next keystroke; the characters it gets right are the longest start of it that the person then
types (what Tab would take), each typed character counted once however many completions had it.
Systems run one after the other, on the same trace, nothing else busy:

  llama-server /infill with llama.vscode's recommended settings for Qwen2.5-Coder (-ub 1024 -b 1024
      --cache-reuse 256, the model's context, the same threads), llama.vscode's request fields;
  llmd (its defaults) through /infill (the same request), Ollama's /api/generate with `suffix`
      (Continue, Twinny) and OpenAI's /v1/completions with `suffix`.

    python benchmarks/autocomplete.py --model ~/.cache/llmd/test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT, cpu_name, free_port, start_llmd_with, wait_http  # noqa: E402

CPS = 6.0  # characters typed per second
WORD_PAUSE, LINE_PAUSE = 0.6, 1.5  # seconds the person stops at a word end, at a line end
BEFORE, AFTER = 48, 16  # lines of context before the cursor and after the code being written
N_PREDICT = 24


@dataclass
class Event:
    at: int  # the cursor, an offset into the file
    pause: float


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)  # of the completions shown in time
    covered: set[int] = field(default_factory=set)  # offsets of typed characters a shown completion had right
    typed: int = 0
    dropped: int = 0
    errors: int = 0
    sent: int = 0


def trace(text: str, start_line: int, words: int) -> tuple[list[Event], int]:
    """Pauses at word ends from `start_line` on: (events, the offset where the typing ends)."""
    start = sum(len(line) for line in text.splitlines(keepends=True)[: start_line - 1])
    events = []
    for m in re.finditer(r"\w(?=[^\w])", text[start:]):
        at = start + m.end()
        events.append(Event(at, LINE_PAUSE if text[at] == "\n" else WORD_PAUSE))
        if len(events) == words:
            break
    return events, events[-1].at


def windows(text: str, at: int, end: int) -> tuple[str, str, str]:
    """(the lines before the cursor's line, the cursor's line up to it, what follows the code being
    written): what the editor sends."""
    line_start = text.rfind("\n", 0, at) + 1
    before = "".join(text[:line_start].splitlines(keepends=True)[-BEFORE:])
    after_start = text.find("\n", end) + 1
    after = "".join(text[after_start:].splitlines(keepends=True)[:AFTER])
    return before, text[line_start:at], after


def request(route: str, model: str, before: str, line: str, after: str) -> tuple[str, dict]:
    indent = len(line) - len(line.lstrip(" "))
    if route == "/infill":  # llama.vscode's fields (its samplers; the server's default temperature)
        return route, {"input_prefix": before, "prompt": line, "input_suffix": after, "input_extra": [],
                       "n_predict": N_PREDICT, "top_k": 40, "top_p": 0.99, "stream": False,
                       "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
                       "t_max_predict_ms": 1000, "n_indent": indent, "model": model}
    if route == "/api/generate":
        return route, {"model": model, "prompt": before + line, "suffix": after, "stream": False,
                       "options": {"num_predict": N_PREDICT, "top_k": 40, "top_p": 0.99, "temperature": 0.8}}
    return route, {"model": model, "prompt": before + line, "suffix": after, "max_tokens": N_PREDICT,
                   "top_p": 0.99, "temperature": 0.8}


def completion_of(route: str, body: dict) -> str:
    if route == "/infill":
        return str(body.get("content", ""))
    if route == "/api/generate":
        return str(body.get("response", ""))
    return str(body["choices"][0]["text"])


def common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(url: str, route: str, model: str, text: str, events: list[Event], end: int, verbose: bool = False) -> Result:
    """Type the trace in real time; each pause's request is dropped when the pause ends."""
    out = Result()
    cursor = events[0].at - 1
    for ev in events:
        time.sleep((ev.at - cursor) / CPS)  # typing up to this word end
        out.typed += ev.at - cursor
        cursor = ev.at
        path, body = request(route, model, *windows(text, ev.at, end))
        got: dict[str, object] = {}

        def ask(path: str = path, body: dict = body, got: dict[str, object] = got, pause: float = ev.pause) -> None:
            t0 = time.perf_counter()
            try:
                # the next keystroke drops it: the read times out at the pause's end and the
                # connection closes, as an editor's cancelled fetch does
                r = httpx.post(url + path, json=body, timeout=httpx.Timeout(pause, connect=5.0))
                got["latency"] = time.perf_counter() - t0
                got["status"] = r.status_code
                got["text"] = completion_of(path, r.json()) if r.status_code == 200 else r.text
            except httpx.TimeoutException:
                got["late"] = True

        out.sent += 1
        t = threading.Thread(target=ask)
        t.start()
        t.join(ev.pause + 0.05)
        t.join()  # the timeout has fired by now: nothing more to wait for
        if verbose:
            line = text[text.rfind("\n", 0, ev.at) + 1:ev.at]
            print(f"  {line[-30:]!r:>34} {ev.pause:.1f} s: " + (
                "dropped" if got.get("late") else f"{got.get('latency', 0):.2f} s {str(got.get('text'))[:40]!r}"),
                file=sys.stderr, flush=True)
        if got.get("late"):
            out.dropped += 1
        elif got.get("status") != 200:
            out.errors += 1
        else:
            out.latencies.append(float(got["latency"]))  # type: ignore[arg-type]
            right = common(str(got["text"]), text[ev.at:end])
            out.covered.update(range(ev.at, ev.at + right))  # a character two completions had right counts once
            time.sleep(max(0.0, ev.pause - float(got["latency"])))  # type: ignore[arg-type]
    return out


def llama_server(model: str) -> tuple[subprocess.Popen, str]:
    tool = ROOT.parent / "shared" / "tools" / "build-llama-server.sh"
    if not tool.exists():
        tool = ROOT / "scripts" / "build-llama-server.sh"
    bin_dir = Path(subprocess.run(["bash", str(tool)], capture_output=True, text=True, check=True).stdout.strip())
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    port = free_port()
    args = [str(bin_dir / "llama-server"), "-m", model, "-ub", "1024", "-b", "1024", "--cache-reuse", "256", "-c", "0",
            "-t", str(os.cpu_count() or 2), "--port", str(port), "--host", "127.0.0.1",
            *(["--no-repack"] if amx else [])]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, timeout=300)
    while httpx.get(url + "/health", timeout=5).status_code != 200:
        time.sleep(0.2)
    return proc, url


def row(name: str, r: Result) -> str:
    shown = len(r.latencies)
    lat = sorted(r.latencies)
    p50 = f"{statistics.median(lat):.2f}" if lat else "-"
    p90 = f"{lat[min(len(lat) - 1, int(0.9 * len(lat)))]:.2f}" if lat else "-"
    return (f"| {name} | {shown}/{r.sent} | {p50} | {p90} | {len(r.covered)} of {r.typed} ({len(r.covered) / max(1, r.typed):.0%}) "
            f"| {r.dropped} | {r.errors} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="a FIM GGUF (repeat for several)")
    ap.add_argument("--words", type=int, default=80, help="word ends to pause at (default 80)")
    ap.add_argument("--start-line", type=int, default=120)
    ap.add_argument("--routes", default="/infill,/api/generate,/v1/completions")
    ap.add_argument("--systems", default="llama-server,llmd", help="which to run (default both)")
    ap.add_argument("--verbose", action="store_true", help="each request's outcome on stderr")
    args = ap.parse_args()
    source = Path(textwrap.__file__)
    text = source.read_text()
    events, end = trace(text, args.start_line, args.words)
    print(f"# autocomplete: {source} from line {args.start_line}, {len(events)} word ends, {CPS:g} chars/s, pauses "
          f"{WORD_PAUSE:g} s (word) / {LINE_PAUSE:g} s (line), {BEFORE}-line prefix, {AFTER}-line suffix, n_predict "
          f"{N_PREDICT}; {cpu_name()}, {os.cpu_count()} CPUs")
    for model in args.model:
        name = Path(model).stem
        print(f"\n## {name}\n\n| system | shown in time | p50 s | p90 s | characters accepted | dropped | errors |\n"
              "|---|---|---|---|---|---|---|")
        systems = args.systems.split(",")
        if "llama-server" in systems:
            proc, url = llama_server(model)
            try:
                httpx.post(url + "/infill", json={"input_prefix": "def f():\n    ", "input_suffix": "\n",
                                                  "n_predict": 4}, timeout=300)
                print(row("llama-server /infill", run(url, "/infill", name, text, events, end, args.verbose)),
                      flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
        for route in args.routes.split(",") if "llmd" in systems else ():  # a fresh daemon each: no route
            lp, lurl, _ = start_llmd_with({name: model})                   # warms the next one's caches
            try:
                print(row(f"llmd {route}", run(lurl, route, name, text, events, end, args.verbose)), flush=True)
            finally:
                lp.terminate()
                lp.wait(30)


if __name__ == "__main__":
    main()
