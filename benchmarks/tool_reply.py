"""A long reply with tools offered: does it stream as fast at its end as at its start, and as fast
as the same reply without tools?

With tools offered (tool_choice auto) llmd samples under a lazy grammar: the model writes freely
until it writes `<tool_call>`, and llama.cpp searches all text written so far for that trigger
after every token. Agents (Codex, Claude Code, opencode) offer tools on every request, and a 1.5B
model now and then writes thousands of tokens of text in one turn; a search that grows with the
text slowed such a reply from 7.4 to 2.7 tokens/s over its first 800 tokens.

Each round sends the same long-list prompt with and without tools (the order alternates, a new
seed each round, temperature 0.8), and reports per reply the rate of its first and its last 100
pieces; then the medians of last/first with tools and without, and the ratio of the two.

    python benchmarks/tool_reply.py [--model PATH] [--rounds 3] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import cpu_name, med, start_llmd_with, stop  # noqa: E402

PROMPT = ("Do not call any tool. Write out every number from 1 to 1000 in words, one per line, "
          "as plain text (one, two, three, ...).")
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}, "required": ["path"]}}}
    for name, desc in (("write_file", "Write text to a file."), ("read_file", "Read a file."))]
EDGE = 100  # pieces timed at each end of a reply


def reply(url: str, model: str, tools: bool, seed: int, tokens: int) -> list[float]:
    """The arrival times of a streamed reply's content pieces."""
    body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0.8, "seed": seed,
            "messages": [{"role": "user", "content": PROMPT}], **({"tools": TOOLS} if tools else {})}
    arrivals: list[float] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800,
                      headers={"Cache-Control": "no-store"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:]).get("choices", []):
                    if (ch.get("delta") or {}).get("content"):
                        arrivals.append(time.perf_counter())
    return arrivals


def rate(ts: list[float]) -> float:
    return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/llmd/test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1000)
    args = ap.parse_args()
    name = Path(args.model).stem
    proc, url, _ = start_llmd_with({name: args.model})
    print(f"CPU: {cpu_name()}; model {Path(args.model).name}; llmd's defaults; {args.rounds} rounds of "
          f"{args.tokens} tokens at most")
    print(f"{'round':>5} {'tools':>5} {'pieces':>6} {'first tok/s':>11} {'last tok/s':>10} {'last/first':>10}")
    ends: dict[bool, list[float]] = {False: [], True: []}
    lasts: dict[bool, list[float]] = {False: [], True: []}
    try:
        for i in range(args.rounds):
            for tools in ((False, True) if i % 2 == 0 else (True, False)):
                ts = reply(url, name, tools, 1000 + i, args.tokens)
                if len(ts) < 3 * EDGE:
                    print(f"{i + 1:>5} {str(tools):>5} {len(ts):>6}   (shorter than {3 * EDGE} pieces: not timed)")
                    continue
                first, last = rate(ts[:EDGE]), rate(ts[-EDGE:])
                ends[tools].append(last / first)
                lasts[tools].append(last)
                print(f"{i + 1:>5} {str(tools):>5} {len(ts):>6} {first:>11.1f} {last:>10.1f} {last / first:>9.2f}x")
    finally:
        stop(proc)
    print(f"median last/first: without tools {med(ends[False]):.2f}x, with tools {med(ends[True]):.2f}x; "
          f"last {EDGE} pieces with tools / without: {med(lasts[True]) / med(lasts[False]):.2f}x")


if __name__ == "__main__":
    main()
