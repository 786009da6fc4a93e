"""A coding agent's sessions replayed against llmd and llama-server: the second session, and the first
after a restart, should find the agent's long prompt (its system prompt and tools, ~12,000 tokens
for Claude Code) already computed.

The recordings (benchmarks/data/*.jsonl) are real sessions of the agents on Qwen2.5-Coder-1.5B,
taken through tests/recorder.py: each line a request as the agent sent it. Each system replays a
recording three times: session 1 (cold), session 2 (a new session of the same agent: its prompt
should be found), then the server is restarted and session 3 runs (llmd keeps its prefix cache on
disk; llama-server starts cold). Requests go one after another, each when the previous one has
finished, with the model renamed to the server's, temperature 0 and at most MAX_TOKENS tokens per
reply (the replies then depend on the model only, not on sampling). The systems take turns, never
running at once. llama-server gets `--cache-reuse 256` (its KV shifting, as llama.vscode sets it),
the same threads and slots, and a context that holds the prompts; llmd runs with its defaults.

    python benchmarks/agents.py --model QWEN_1.5B.gguf [--draft QWEN_0.5B.gguf] [--recording F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import cpu_name, start_llmd_with, stop, wait_idle  # noqa: E402
from vs_llama_server import llama_server  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
MAX_TOKENS = 128
SERVER_CTX = 4 * 16384  # four slots of 16,384 tokens: Claude Code's prompt and its replies fit one


def load(path: Path, model: str, function_tools_only: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The recording's requests as both systems get them; with `function_tools_only`, a Responses
    request keeps only its function tools (llama-server leaves Codex's namespace, custom and hosted
    tools out of the prompt, llmd shows them to the model: the prompts then differ)."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["path"].startswith("/api/pull"):  # Codex --oss asks Ollama for the model first
            continue
        # the Responses API (Codex) names its cap max_output_tokens; the others max_tokens
        cap = "max_output_tokens" if rec["path"].endswith("/responses") else "max_tokens"
        body = {**rec["body"], "model": model, "temperature": 0, "stream": True,
                cap: min(MAX_TOKENS, int(rec["body"].get(cap) or MAX_TOKENS))}
        for k in ("top_p", "top_k"):
            body.pop(k, None)
        if function_tools_only and "tools" in body:
            body["tools"] = [t for t in body["tools"] if t.get("type", "function") == "function"]
        out.append((rec["path"], body))
    return out


def _generated(data: str) -> bool:
    """Whether an SSE event carries generated text or call arguments: a chat stream's first chunk
    may be the role alone, sent before the prompt is read (llmd sends it at once)."""
    try:
        ev = json.loads(data)
    except ValueError:
        return False
    if not isinstance(ev, dict):
        return False
    if ev.get("choices"):  # OpenAI chat and completions
        c = ev["choices"][0]
        d = c.get("delta") or {}
        return bool(d.get("content") or d.get("tool_calls") or d.get("reasoning_content") or c.get("text"))
    kind = str(ev.get("type", ""))  # Anthropic's content_block_delta; the Responses API's *.delta
    return kind == "content_block_delta" or (kind.startswith("response.") and kind.endswith(".delta"))


def send(url: str, path: str, body: dict[str, Any]) -> tuple[float, float]:
    """(time to the first content event, total) of one streamed request, in seconds."""
    t0 = time.perf_counter()
    first = None
    with httpx.Client(timeout=1800) as c, c.stream("POST", url + path, json=body,
                                                   headers={"anthropic-version": "2023-06-01",
                                                            "Cache-Control": "no-store"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}{path}: {r.status_code} {r.read()[:500]!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and _generated(line[5:]):
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (first if first is not None else total), total


def session(url: str, requests: list[tuple[str, dict[str, Any]]], idle: Any) -> dict[str, Any]:
    ttfts, t0 = [], time.perf_counter()
    for path, body in requests:
        idle()
        ttft, _ = send(url, path, body)
        ttfts.append(ttft)
        print(f"  {path} ttft {ttft:.2f} s", file=sys.stderr, flush=True)
    out = {"wall": time.perf_counter() - t0, "first": ttfts[0],
           "others": statistics.median(ttfts[1:]) if len(ttfts) > 1 else float("nan")}
    print(f"  session: {json.dumps(out)}", file=sys.stderr, flush=True)  # kept if a later step fails
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default="")
    ap.add_argument("--recording", default=str(DATA / "claude-code-2.1.332-read-session.jsonl"))
    ap.add_argument("--function-tools-only", action="store_true",
                    help="Responses requests keep only their function tools, so both systems read the same prompt")
    args = ap.parse_args()
    name = Path(args.model).stem.lower()
    models = {name: args.model, **({Path(args.draft).stem.lower(): args.draft} if args.draft else {})}
    requests = load(Path(args.recording), name, args.function_tools_only)
    results: dict[str, list[dict[str, Any]]] = {}

    print(f"# llmd with its defaults, {len(requests)} requests per session", file=sys.stderr, flush=True)
    proc, url, home = start_llmd_with(models, {})
    try:
        idle = lambda: wait_idle(url)  # noqa: E731
        results["llmd"] = [session(url, requests, idle), session(url, requests, idle)]
        idle()
    finally:
        stop(proc)
    proc, url, _ = start_llmd_with(models, {}, home)
    try:
        results["llmd"].append(session(url, requests, lambda: wait_idle(url)))
    finally:
        stop(proc)

    extra = ("-c", str(SERVER_CTX), "--cache-reuse", "256")
    print("# llama-server", file=sys.stderr, flush=True)
    sp, surl, sargs = llama_server(args.model, extra)
    try:
        results["llama-server"] = [session(surl, requests, lambda: None), session(surl, requests, lambda: None)]
    finally:
        stop(sp)  # type: ignore[arg-type]
    sp, surl, _ = llama_server(args.model, extra)
    try:
        results["llama-server"].append(session(surl, requests, lambda: None))
    finally:
        stop(sp)  # type: ignore[arg-type]

    print(f"# {Path(args.recording).name} replayed on {name}, {cpu_name()}, {os.cpu_count()} CPUs; "
          f"temperature 0, at most {MAX_TOKENS} tokens a reply"
          f"{'; function tools only' if args.function_tools_only else ''}; llmd with its defaults; llama-server "
          f"{' '.join(sargs[2:])}")
    print(f"{'':<44}{'llmd':>12}{'llama-server':>14}{'llmd/server':>13}")
    rows = [("session 1 (cold): first request TTFT (s)", lambda s: s[0]["first"]),
            ("session 1: other requests, median TTFT (s)", lambda s: s[0]["others"]),
            ("session 1: wall time (s)", lambda s: s[0]["wall"]),
            ("session 2: first request TTFT (s)", lambda s: s[1]["first"]),
            ("session 2: wall time (s)", lambda s: s[1]["wall"]),
            ("after a restart: first request TTFT (s)", lambda s: s[2]["first"]),
            ("after a restart: wall time (s)", lambda s: s[2]["wall"]),
            ("all three sessions: wall time (s)", lambda s: sum(x["wall"] for x in s))]
    for label, get in rows:
        a, b = get(results["llmd"]), get(results["llama-server"])
        print(f"{label:<44}{a:>12.2f}{b:>14.2f}{a / b:>13.2f}")
    for sys_name, s in results.items():
        print(f"{sys_name}: session 2's first request {s[1]['first'] / s[0]['first']:.1%} of session 1's; "
              f"after a restart {s[2]['first'] / s[0]['first']:.1%}")


if __name__ == "__main__":
    main()
